"""The model judge against a real OpenAI-compatible chat-completions server on 127.0.0.1
(`evalbus.testing.chat_server`).

The server checks the request shape and bearer key, records every request with its arrival
time, and answers from a script (documented bodies, 429 + Retry-After, 5xx, garbage, hangs).
Retry timing is asserted from the server's recorded arrival times, never from sleeps.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Any

import msgspec
import pytest

from evalbus.testing.chat_server import ChatCompletionsServer, Reply, completion, error_body, verdict_reply
from evalbus.testing.pipeline import eventually
from evalbus_contracts import (
    CaseExecuted,
    CasePlan,
    CaseResult,
    CaseSpec,
    Infra,
    Invalid,
    JudgeUsage,
    LlmCall,
    Measured,
    Message,
    ModelJudge,
    Score,
    ToolCall,
    ToolResult,
    Unmeasured,
    encode,
)
from evalbus_judge import (
    ChatClient,
    ChatModelJudge,
    JudgeContext,
    JudgeRegistry,
    ModelDefaults,
    RetryPolicy,
    judge_event,
)
from evalbus_runtime.secrets import SecretStore

OPEN = ModelDefaults(allowed_base_urls=("*",))
"""Tests send named secrets to their own local server."""

pytestmark = pytest.mark.integration

API_KEY = "sk-test-4f1c9e0b7d2a6c3e8b5f"
"""The key the server requires; the judge resolves it by the secret name `judge-key`."""
SECRETS = SecretStore(environ={"EVALBUS_SECRET_JUDGE_KEY": API_KEY})
SERVER_USAGE = JudgeUsage(model="judge-test-model", input_tokens=10, output_tokens=5)
"""What every 200 of the server reports; no price, no reported cost: the cost is unmeasured."""


# ---------------------------------------------------------------- the server


@pytest.fixture
async def server() -> AsyncIterator[ChatCompletionsServer]:
    """A started server that requires `API_KEY`."""
    srv = ChatCompletionsServer(api_key=API_KEY)
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def chat() -> AsyncIterator[ChatClient]:
    """A started client with short backoff delays (a Retry-After is still honoured as sent)."""
    client = ChatClient(RetryPolicy(base_delay_s=0.01, max_delay_s=0.05, max_total_wait_s=10.0))
    await client.start()
    yield client
    await client.close()


# ---------------------------------------------------------------- helpers


def context(answer: str = "Paris", expected: str | None = "Paris") -> JudgeContext:
    trace = (
        Message(role="user", text="What is the capital of France?"),
        Infra(scope="placement", event="started", message="started on node-7", node="node-7"),
        LlmCall(t=0.5, model="gpt-x", input_tokens=12, output_tokens=3),
        ToolCall(t=1.0, id="1", name="search", args={"q": "capital of France"}),
        ToolResult(t=1.5, id="1", output="Paris is the capital of France."),
        Message(t=2.0, role="assistant", text=answer),
    )
    result = CaseResult(case_id="c1", run_id="evb-b1-c1", harness="h@1", answer=answer, trace=trace)
    return JudgeContext.of(result, case_input="What is the capital of France?", expected=expected)


def spec(base_url: str | None, **kw: Any) -> ModelJudge:
    fields: dict[str, Any] = {
        "id": "quality",
        "base_url": base_url,
        "model": "judge-test-model",
        "api_key_secret": "judge-key",
        "rubric": "The answer names the capital of France correctly.",
        "timeout_s": 5.0,
        "max_retries": 3,
    }
    fields.update(kw)
    return ModelJudge(**fields)


async def run(chat: ChatClient, judge_spec: ModelJudge, ctx: JudgeContext | None = None) -> Score:
    registry = JudgeRegistry(chat=chat, model_defaults=OPEN, secrets=SECRETS)
    (entry,) = registry.resolve([judge_spec]).judges
    assert isinstance(entry.judge, ChatModelJudge)
    return await entry.judge.judge(ctx or context())


# ---------------------------------------------------------------- protocol


async def test_request_shape_auth_and_measured_score(server: ChatCompletionsServer, chat: ChatClient) -> None:
    server.push(verdict_reply(0.9, True, "names Paris"))
    score = await run(chat, spec(f"{server.root}/v1"))
    assert score == Measured(
        grader_id="quality",
        metric="judge:quality",
        source="judge",
        value=0.9,
        passed=True,
        detail="names Paris",
        usage=SERVER_USAGE,
    )
    assert server.protocol_errors == []
    (req,) = server.requests
    assert req.path == "/v1/chat/completions"
    assert req.headers["Authorization"] == f"Bearer {API_KEY}"
    assert req.body["model"] == "judge-test-model"
    assert req.body["response_format"] == {"type": "json_object"}
    system, user = req.body["messages"]
    assert system["role"] == "system"
    assert "JSON" in system["content"]
    assert user["role"] == "user"
    prompt = user["content"]
    for part in (
        "The answer names the capital of France correctly.",
        "## Task given to the agent\nWhat is the capital of France?",
        "## Expected answer\nParis",
        "## Agent's answer\nParis",
        'tool_call search {"q":"capital of France"}',
        "tool_result ok: Paris is the capital of France.",
        "llm_call gpt-x",
    ):
        assert part in prompt
    assert "node-7" not in prompt  # infra events are not shown to judges
    assert API_KEY not in msgspec.json.encode(req.body).decode()


async def test_no_expected_section_without_expected(server: ChatCompletionsServer, chat: ChatClient) -> None:
    await run(chat, spec(f"{server.root}/v1"), context(expected=None))
    assert "## Expected answer" not in server.requests[0].body["messages"][1]["content"]


@pytest.mark.parametrize(
    ("reply", "value", "passed"),
    [
        (verdict_reply(0.7), 0.7, True),  # no pass: threshold 0.5
        (verdict_reply(0.3), 0.3, False),
        (verdict_reply(0.3, True), 0.3, True),  # the model's boolean pass wins
        (verdict_reply(0.9, False), 0.9, False),
        (verdict_reply(0.7, "yes"), 0.7, True),  # a non-boolean pass is ignored
        (verdict_reply(1), 1.0, True),
        (verdict_reply(0), 0.0, False),
        (Reply(body=completion('Sure!\n```json\n{"score": 0.6, "reasoning": "ok"}\n```')), 0.6, True),
        (Reply(body=completion('```\n{"score": 0.2, "pass": false}\n```')), 0.2, False),
    ],
)
async def test_verdict_shapes(
    server: ChatCompletionsServer, chat: ChatClient, reply: Reply, value: float, passed: bool
) -> None:
    server.push(reply)
    score = await run(chat, spec(f"{server.root}/v1"))
    assert isinstance(score, Measured), score
    assert (score.value, score.passed) == (value, passed)


async def test_pass_threshold_from_spec(server: ChatCompletionsServer, chat: ChatClient) -> None:
    server.push(verdict_reply(0.7), verdict_reply(0.8))
    strict = spec(f"{server.root}/v1", pass_threshold=0.8)
    first, second = await run(chat, strict), await run(chat, strict)
    assert isinstance(first, Measured)
    assert isinstance(second, Measured)
    assert (first.passed, second.passed) == (False, True)


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (verdict_reply(1.5), "outside 0..1"),
        (verdict_reply(-0.1), "outside 0..1"),
        (verdict_reply("0.8"), "must be a number"),
        (verdict_reply(True), "must be a number"),
        (Reply(body=completion('{"pass": true}')), "must be a number"),
        (Reply(body=completion("I think the answer is good.")), "not a JSON object"),
        (Reply(body=completion("[0.5]")), "not a JSON object"),
        (Reply(body=completion(None, refusal="I can't help with that.")), "refused"),
        (Reply(body={"choices": []}), "no choices"),
        (Reply(body={"object": "chat.completion"}), "no choices"),
        (Reply(raw=b"<html>gateway</html>", headers={"Content-Type": "text/html"}), "not JSON"),
    ],
)
async def test_garbage_is_invalid(server: ChatCompletionsServer, chat: ChatClient, reply: Reply, why: str) -> None:
    server.push(reply)
    score = await run(chat, spec(f"{server.root}/v1"))
    assert isinstance(score, Invalid), score
    assert score.reason == "contract_violation"
    assert score.metric == "judge:quality"
    assert why in (score.detail or "")
    assert len(server.requests) == 1  # a contract violation is not retried


# ---------------------------------------------------------------- retries


async def test_429_retry_after_seconds_is_honoured(server: ChatCompletionsServer, chat: ChatClient) -> None:
    server.push(
        Reply(status=429, body=error_body("Rate limit reached", "requests"), headers={"Retry-After": "1"}),
        verdict_reply(0.8, True),
    )
    score = await run(chat, spec(f"{server.root}/v1"))
    assert isinstance(score, Measured)
    first, second = server.requests
    gap = second.at_monotonic - first.at_monotonic
    assert gap >= 1.0, f"retried {gap:.3f} s after a Retry-After of 1 s"
    assert gap < 1.0 + 5.0, "the retry came long after the server allowed it"


async def test_429_retry_after_http_date_is_honoured(server: ChatCompletionsServer, chat: ChatClient) -> None:
    not_before = datetime.fromtimestamp(math.ceil(time.time()) + 2, UTC)
    server.push(
        Reply(status=429, headers={"Retry-After": format_datetime(not_before, usegmt=True)}, body={}),
        verdict_reply(0.8, True),
    )
    score = await run(chat, spec(f"{server.root}/v1"))
    assert isinstance(score, Measured)
    assert server.requests[1].at_wall >= not_before.timestamp()


async def test_retry_after_beyond_the_budget_gives_up_without_waiting(server: ChatCompletionsServer) -> None:
    budget_s = 60.0
    server.push(verdict_reply(0.9, True), Reply(status=429, headers={"Retry-After": "3600"}, body={}))
    async with ChatClient(RetryPolicy(base_delay_s=0.01, max_total_wait_s=budget_s)) as chat:
        began = time.monotonic()
        assert isinstance(await run(chat, spec(f"{server.root}/v1")), Measured)
        answered_s = time.monotonic() - began  # the baseline: one request, answered at once
        began = time.monotonic()
        score = await run(chat, spec(f"{server.root}/v1"))
        gave_up_s = time.monotonic() - began
    assert isinstance(score, Unmeasured), score
    assert (score.reason, score.retryable, score.attempts) == ("grader_error", True, 1)
    assert "retry budget" in (score.detail or "")
    assert len(server.requests) == 2
    # As quick as the answered request: no part of the budget was spent waiting.
    assert gave_up_s < answered_s + budget_s / 2, (gave_up_s, answered_s)


async def test_a_rate_limit_backs_off_without_spending_a_retry(server: ChatCompletionsServer, chat: ChatClient) -> None:
    """With no retry allowed, a provider that answers 429 three times is still waited for (its
    Retry-After), while a 500 ends the completion at once: only real failures spend retries."""
    busy = Reply(status=429, body=error_body("Rate limit reached", "requests"), headers={"Retry-After": "0"})
    server.push(busy, busy, busy, verdict_reply(0.7, True))
    score = await run(chat, spec(f"{server.root}/v1", max_retries=0))
    assert isinstance(score, Measured), score
    assert score.value == 0.7
    assert len(server.requests) == 4
    server.push(Reply(status=500, body=error_body("internal", "server_error")), verdict_reply(0.7, True))
    failed = await run(chat, spec(f"{server.root}/v1", max_retries=0))
    assert isinstance(failed, Unmeasured), failed
    assert (failed.reason, failed.attempts) == ("grader_error", 1)
    assert len(server.requests) == 5


async def test_5xx_is_retried_then_measured(server: ChatCompletionsServer, chat: ChatClient) -> None:
    server.push(
        Reply(status=500, body=error_body("internal", "server_error")),
        Reply(status=503, body=error_body("overloaded", "server_error")),
        verdict_reply(0.4, False),
    )
    score = await run(chat, spec(f"{server.root}/v1"))
    assert isinstance(score, Measured)
    assert score.passed is False
    assert len(server.requests) == 3


async def test_5xx_exhausting_retries_is_retryable_grader_error(
    server: ChatCompletionsServer, chat: ChatClient
) -> None:
    server.push(*[Reply(status=502, body=error_body("bad gateway", "server_error"))] * 3)
    score = await run(chat, spec(f"{server.root}/v1", max_retries=2))
    assert isinstance(score, Unmeasured), score
    assert (score.reason, score.retryable, score.attempts) == ("grader_error", True, 3)
    assert "HTTP 502" in (score.detail or "")
    assert len(server.requests) == 3


async def test_timeout_after_retries_is_grader_timeout(server: ChatCompletionsServer, chat: ChatClient) -> None:
    server.push(Reply(hang=True), Reply(hang=True))
    score = await run(chat, spec(f"{server.root}/v1", timeout_s=0.3, max_retries=1))
    assert isinstance(score, Unmeasured), score
    assert (score.reason, score.retryable, score.attempts) == ("grader_timeout", True, 2)
    assert len(server.requests) == 2
    assert server.requests[1].at_monotonic - server.requests[0].at_monotonic >= 0.3


async def test_timeout_then_success(server: ChatCompletionsServer, chat: ChatClient) -> None:
    server.push(Reply(hang=True), verdict_reply(0.9, True, "names Paris"))
    score = await run(chat, spec(f"{server.root}/v1", timeout_s=0.3, max_retries=1))
    # The first request never got an answer, so this verdict is the retry's.
    assert score == Measured(
        grader_id="quality",
        metric="judge:quality",
        source="judge",
        value=0.9,
        passed=True,
        detail="names Paris",
        usage=SERVER_USAGE,
    )
    first, second = server.requests
    assert second.body == first.body  # the same request, sent again
    assert second.headers["Authorization"] == f"Bearer {API_KEY}"
    assert server.protocol_errors == []
    # The client gave up on the first request (it hung up), rather than the server answering it.
    await eventually(lambda: server.abandoned == [0], timeout_s=10, what="the hung request to be abandoned")


async def test_client_error_is_not_retried(server: ChatCompletionsServer, chat: ChatClient) -> None:
    server.push(Reply(status=404, body=error_body("The model does not exist", "invalid_request_error")))
    score = await run(chat, spec(f"{server.root}/v1"))
    assert isinstance(score, Unmeasured), score
    assert (score.reason, score.retryable, score.attempts) == ("grader_error", False, 1)
    assert "HTTP 404" in (score.detail or "")


async def test_connection_refused_is_retryable_grader_error(chat: ChatClient) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens on this port now
    score = await run(chat, spec(f"http://127.0.0.1:{port}/v1", max_retries=1))
    assert isinstance(score, Unmeasured), score
    assert (score.reason, score.retryable, score.attempts) == ("grader_error", True, 2)


# ---------------------------------------------------------------- secrets and endpoints


async def test_wrong_key_is_rejected_by_the_server(server: ChatCompletionsServer, chat: ChatClient) -> None:
    wrong = SecretStore(environ={"EVALBUS_SECRET_JUDGE_KEY": "sk-wrong"})
    (entry,) = JudgeRegistry(chat=chat, model_defaults=OPEN, secrets=wrong).resolve([spec(f"{server.root}/v1")]).judges
    score = await entry.judge.judge(context())
    assert isinstance(score, Unmeasured)
    assert "HTTP 401" in (score.detail or "")


async def test_missing_secret_makes_no_call(server: ChatCompletionsServer, chat: ChatClient) -> None:
    score = await run_registry(chat, spec(f"{server.root}/v1", api_key_secret="not-set"))
    assert isinstance(score, Unmeasured)
    assert score.reason == "missing_secret"
    assert server.requests == []


async def test_secret_removed_after_resolution_makes_no_call(server: ChatCompletionsServer, chat: ChatClient) -> None:
    environ = {"EVALBUS_SECRET_JUDGE_KEY": API_KEY}
    registry = JudgeRegistry(chat=chat, model_defaults=OPEN, secrets=SecretStore(environ=environ))
    (entry,) = registry.resolve([spec(f"{server.root}/v1")], batch_id="b-rotate").judges
    del environ["EVALBUS_SECRET_JUDGE_KEY"]
    score = await entry.judge.judge(context())
    assert isinstance(score, Unmeasured)
    assert score.reason == "missing_secret"
    assert server.requests == []


async def test_secret_from_secrets_dir(server: ChatCompletionsServer, chat: ChatClient, tmp_path: Any) -> None:
    (tmp_path / "judge-key").write_text(API_KEY + "\n")
    registry = JudgeRegistry(
        chat=chat, model_defaults=OPEN, secrets=SecretStore(environ={"EVALBUS_SECRETS_DIR": str(tmp_path)})
    )
    (entry,) = registry.resolve([spec(f"{server.root}/v1")]).judges
    assert isinstance(await entry.judge.judge(context()), Measured)
    assert server.requests[0].headers["Authorization"] == f"Bearer {API_KEY}"


async def test_default_endpoint_and_key_from_service_settings(server: ChatCompletionsServer, chat: ChatClient) -> None:
    registry = JudgeRegistry(
        chat=chat,
        secrets=SECRETS,
        model_defaults=ModelDefaults(base_url=f"{server.root}/v1", api_key_secret="judge-key"),
    )
    (entry,) = registry.resolve([spec(None, api_key_secret=None)]).judges
    assert isinstance(await entry.judge.judge(context()), Measured)
    assert server.requests[0].headers["Authorization"] == f"Bearer {API_KEY}"


async def test_service_key_is_never_sent_to_a_url_the_batch_chose(chat: ChatClient) -> None:
    other = ChatCompletionsServer(api_key=None)
    await other.start()
    try:
        registry = JudgeRegistry(
            chat=chat,
            secrets=SECRETS,
            model_defaults=ModelDefaults(base_url="http://127.0.0.1:9/v1", api_key_secret="judge-key"),
        )
        (entry,) = registry.resolve([spec(f"{other.root}/custom/v1", api_key_secret=None)]).judges
        assert isinstance(await entry.judge.judge(context()), Measured)
        (req,) = other.requests
        assert req.path == "/custom/v1/chat/completions"
        assert "Authorization" not in req.headers
    finally:
        await other.stop()


async def test_no_base_url_anywhere_is_unsupported(chat: ChatClient) -> None:
    score = await run_registry(chat, spec(None))
    assert isinstance(score, Unmeasured)
    assert (score.reason, score.retryable) == ("unsupported", False)


async def test_the_key_never_appears_in_scores_or_events(server: ChatCompletionsServer, chat: ChatClient) -> None:
    """Error bodies that quote the Authorization header, and a verdict that repeats it, are scrubbed."""
    base = f"{server.root}/v1"
    server.push(
        Reply(status=401, echo_auth=True),
        Reply(status=500, echo_auth=True),
        Reply(status=500, echo_auth=True),
        verdict_reply(0.9, True, reasoning=f"the header was Bearer {API_KEY}"),
        Reply(body=completion(f"not json {API_KEY}")),
    )
    judges = (
        spec(base, id="a", max_retries=0),
        spec(base, id="b", max_retries=1),
        spec(base, id="c"),
        spec(base, id="d"),
    )
    event = CaseExecuted(
        batch_id="b-secret",
        case_id="c1",
        run_id="evb-b-secret-c1",
        status="succeeded",
        result=context().result,
        plan=CasePlan(judges=judges),
        case=CaseSpec(id="c1", input="What is the capital of France?", expected="Paris"),
    )
    judged = await judge_event(event, JudgeRegistry(chat=chat, model_defaults=OPEN, secrets=SECRETS))
    assert judged is not None
    statuses = [type(s).__name__ for s in judged.result.scores]
    assert statuses == ["Unmeasured", "Unmeasured", "Measured", "Invalid"]
    assert all(r.headers.get("Authorization") == f"Bearer {API_KEY}" for r in server.requests)
    assert API_KEY not in encode(judged).decode()
    assert "***" in (judged.result.scores[0].detail or "")


async def run_registry(chat: ChatClient, judge_spec: ModelJudge) -> Score:
    (entry,) = JudgeRegistry(chat=chat, model_defaults=OPEN, secrets=SECRETS).resolve([judge_spec]).judges
    return await entry.judge.judge(context())
