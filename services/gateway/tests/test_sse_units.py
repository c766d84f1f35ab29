"""SSE framing and parsing as pure logic: frames survive any chunking and multi-line data; the
fan-out's per-client buffer hands over in order and cuts a client only by its rules."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from evalbus_api.client import SseEvent, SseParser
from evalbus_gateway.api.sse import end_frame, event_type, final_status, frame
from evalbus_gateway.live.fanout import Lagged, Watcher

pytestmark = pytest.mark.unit


def test_frames_round_trip_through_the_parser_in_any_chunking() -> None:
    stream = (
        b": hello\n\n"
        + frame(b'{"type":"case.executed","x":1}', event="case.executed", event_id=41)
        + b": heartbeat\n\n"
        + frame(b"line one\nline two", event="note", event_id=42)
        + end_frame("b1", "cancelled")
    )
    expected = [
        SseEvent(41, "case.executed", '{"type":"case.executed","x":1}'),
        SseEvent(42, "note", "line one\nline two"),
        SseEvent(None, "end", '{"batch_id":"b1","status":"cancelled"}'),
    ]
    for size in (1, 2, 7, len(stream)):
        parser = SseParser()
        events = [e for i in range(0, len(stream), size) for e in parser.feed(stream[i : i + size])]
        assert events == expected, size


def test_crlf_lines_and_unknown_fields() -> None:
    parser = SseParser()
    events = parser.feed(b"retry: 10\r\nid: 7\r\nevent: x\r\ndata: a\r\n\r\n")
    assert events == [SseEvent(7, "x", "a")]
    # an id that is not ASCII digits is no id; a block of only an id lends it to no later event
    events = parser.feed("id: \u00b2\ndata: b\n\nid: 9\n\ndata: c\n\n".encode())
    assert events == [SseEvent(None, "message", "b"), SseEvent(None, "message", "c")]


def test_event_type_from_header_or_payload() -> None:
    assert event_type({"Evalbus-Type": "case.judged"}, b"{}") == "case.judged"
    assert event_type(None, b'{"type": "batch.finalized"}') == "batch.finalized"
    assert event_type({}, b"not json") == "message"


def test_final_status() -> None:
    assert final_status(b'{"type": "batch.finalized", "status": "superseded"}') == "superseded"
    assert final_status(b"garbage") == "failed"


def test_event_names_cannot_break_the_framing() -> None:
    assert frame(b"d", event="a\nb") == b"event: a b\ndata: d\n\n"


# ---------------------------------------------------------------- the fan-out's per-client buffer


@dataclass(frozen=True)
class _Item:
    seq: int


def cut(watcher: Watcher[_Item]) -> bool:
    """Whether the watcher was cut (read through a call: mypy would hold on to an earlier answer)."""
    return watcher.lagged


class _BackedUp:
    """A response whose write waits until released (a client that does not read)."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        await self.released.wait()
        self.written.append(data)


async def test_a_watcher_hands_over_what_waits_in_order_and_wakes_on_an_offer() -> None:
    watcher: Watcher[_Item] = Watcher(4)
    assert await watcher.take(0.0) == []  # nothing came
    taking = asyncio.ensure_future(watcher.take(30.0))
    await asyncio.sleep(0)  # the taker waits
    watcher.offer(_Item(1))
    watcher.offer(_Item(2))
    assert await asyncio.wait_for(taking, 5) == [_Item(1), _Item(2)]


async def test_a_watcher_is_cut_at_its_limit_only_while_its_client_is_backed_up() -> None:
    lags: list[int] = []
    watcher: Watcher[_Item] = Watcher(4, on_lag=lambda: lags.append(1))
    for seq in range(1, 9):  # twice the limit, but nothing is being written: a burst, kept
        watcher.offer(_Item(seq))
    assert not cut(watcher)
    assert [i.seq for i in await watcher.take(0.0)] == list(range(1, 9))
    response = _BackedUp()
    writing = asyncio.ensure_future(watcher.write(response, b"x"))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    for seq in range(9, 14):
        watcher.offer(_Item(seq))
    assert cut(watcher)
    assert lags == [1]
    with pytest.raises(Lagged):
        await watcher.take(0.0)  # the buffer was dropped
    response.released.set()
    await writing


async def test_a_watcher_is_cut_at_four_times_its_limit_in_any_case() -> None:
    watcher: Watcher[_Item] = Watcher(4)
    for seq in range(1, 17):
        watcher.offer(_Item(seq))
    assert not cut(watcher)
    watcher.offer(_Item(17))
    assert cut(watcher)
