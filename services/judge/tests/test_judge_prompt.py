"""Pure parts of the model judge: Retry-After parsing, the compact trace, the verdict reader."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from evalbus_contracts import Artifact, EnvAction, Error, Log, Message, Span, TraceEvent
from evalbus_judge import parse_retry_after
from evalbus_judge.chat import RetryPolicy
from evalbus_judge.model import EVENT_LIMIT, ModelVerdict, compact_trace, read_verdict

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("5", 5.0),
        (" 0 ", 0.0),
        ("1.5", 1.5),
        ("-3", 0.0),
        ("", None),
        (None, None),
        ("soon", None),
        ("inf", None),
        ("nan", None),
        ("Wed, 21 Oct 2015 07:28:10 GMT", 10.0),
        ("Wed, 21 Oct 2015 07:27:00 GMT", 0.0),
    ],
)
def test_parse_retry_after(header: str | None, seconds: float | None) -> None:
    now = datetime(2015, 10, 21, 7, 28, 0, tzinfo=UTC)
    assert parse_retry_after(header, now=now) == seconds


def test_parse_retry_after_date_is_relative_to_now() -> None:
    later = datetime.now(UTC) + timedelta(seconds=30)
    parsed = parse_retry_after(format_datetime(later, usegmt=True))
    assert parsed is not None
    assert 28.0 <= parsed <= 30.0


def test_backoff_is_exponential_and_capped() -> None:
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=5.0)
    for retry, ceiling in [(0, 1.0), (1, 2.0), (2, 4.0), (3, 5.0), (10, 5.0)]:
        delay = policy.backoff(retry)
        assert ceiling / 2 <= delay <= ceiling


def test_compact_trace_lists_every_event_when_it_fits() -> None:
    trace: tuple[TraceEvent, ...] = (
        Message(t=0, role="user", text="hi\nthere"),
        EnvAction(t=1, action="click", detail="#submit"),
        Error(t=2, message="boom"),
        Log(t=3, stream="stderr", text="warn"),
        Artifact(t=4, name="shot.png", ref="artifacts/x", media_type="image/png"),
        Span(t=5, name="retrieve"),
    )
    text = compact_trace(trace)
    assert text.splitlines() == [
        "[0s] user: hi there",
        "[1s] env_action click: #submit",
        "[2s] error: boom",
        "[3s] stderr: warn",
        "[4s] artifact shot.png (image/png)",
        "[5s] span retrieve",
    ]
    assert compact_trace(()) == "(empty)"


def test_compact_trace_keeps_head_and_tail_within_budget() -> None:
    trace = tuple(Message(t=i, role="assistant", text=f"step {i} " + "x" * 1000) for i in range(100))
    text = compact_trace(trace, limit=4000)
    lines = text.splitlines()
    assert len(text) <= 4000 + 40
    assert all(len(line) <= EVENT_LIMIT for line in lines)
    assert lines[0].startswith("[0s] assistant: step 0 ")
    assert lines[-1].startswith("[99s] assistant: step 99 ")
    omitted = next(line for line in lines if "events omitted" in line)
    assert int(omitted.split()[1]) == 100 - (len(lines) - 1)


def test_read_verdict() -> None:
    body = {
        "choices": [{"message": {"role": "assistant", "content": '{"score": 0.5, "pass": true, "reasoning": "r"}'}}]
    }
    assert read_verdict(body) == ModelVerdict(score=0.5, passed=True, reasoning="r")
    assert isinstance(read_verdict(None), str)
    assert isinstance(read_verdict({"choices": [{"message": "text"}]}), str)
    assert isinstance(read_verdict({"choices": [{"message": {"content": '{"score": 1e400}'}}]}), str)
