"""The LIVE stream's publisher of one running case (`LiveBus`): what the live tee (`live.py`) and the
backends' marks and samples send, as `LiveLog`, `LiveTrace`, `InfraMark` and `LivePlacement`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Literal, TypedDict

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from evalbus_contracts import (
    CaseRequested,
    DecodeError,
    Infra,
    InfraMark,
    LiveLog,
    LivePlacement,
    LiveTrace,
    PlacementSample,
    TraceEvent,
    decode_event,
    new_event_id,
    subjects,
)
from evalbus_contracts.streams import LIVE
from evalbus_dispatcher.execute import run_id_of
from evalbus_runtime import Publisher

log = logging.getLogger("evalbus.dispatcher")


class _Ids(TypedDict):
    batch_id: str | None
    case_id: str | None
    run_id: str
    attempt: int
    execution: str


class LiveBus:
    """A running case's live output onto the LIVE stream (`run.<run>.live.*`), best effort: published
    without waiting for acknowledgements (the sealed trace in `case.executed` is the record).

    Each execution gets an id of its own (in every message id, so a redelivered attempt's messages
    are not taken for duplicates of the first one's); each call is one message (the live tee
    bounds a trace call to 64 KiB of events and groups the marks of a run's first 0.1 s); log
    chunks carry their byte `offset` in the
    run's whole live log, continued from the log already on the stream (`resume`)."""

    def __init__(self, publisher: Publisher, req: CaseRequested) -> None:
        self._pub = publisher
        self._req = req
        self._run_id = run_id_of(req)
        self._execution = new_event_id()[:16]
        self._seq = {"stdout": 0, "stderr": 0, "trace": 0, "infra": 0, "placement": 0}
        self._t0 = time.monotonic()
        self._by_runner = False
        self.offset = 0
        """Bytes of the run's live log published so far (where the next chunk starts)."""

    @property
    def execution(self) -> str:
        """This execution's id (in every message)."""
        return self._execution

    @property
    def by_runner(self) -> bool:
        """Whether the job's runner publishes the live log and trace itself (this bus then does not)."""
        return self._by_runner

    def clock(self) -> float:
        """Seconds since this execution began (about the run's clock: it began just before)."""
        return time.monotonic() - self._t0

    def runner_publishes(self) -> None:
        """The runner said it publishes the live log and trace itself (`started` with `live: nats`):
        relaying them too would show every line twice."""
        self._by_runner = True

    def _ids(self) -> _Ids:
        """Who every message of this execution is about."""
        req = self._req
        return _Ids(
            batch_id=req.batch_id, case_id=req.case_id, run_id=self._run_id, attempt=req.attempt,
            execution=self._execution,
        )  # fmt: skip

    def _next(self, channel: str) -> int:
        self._seq[channel] += 1
        return self._seq[channel]

    async def resume(self, js: JetStreamContext) -> None:
        """Continue the run's log offsets after what an earlier attempt or execution left on the
        stream (best effort: without it the offsets restart and only the tail search degrades)."""
        try:
            raw = await js.get_last_msg(LIVE.name, subjects.live_subject(self._run_id, "log"))
            last = decode_event(raw.data or b"")
        except nats.js.errors.NotFoundError:
            return
        except (nats.errors.Error, DecodeError) as e:
            log.warning("live log of %s not continued: %s", self._run_id, e)
            return
        if isinstance(last, LiveLog):
            self.offset = last.offset + len(last.text.encode("utf-8"))

    async def log(self, stream: Literal["stdout", "stderr"], text: str) -> None:
        if self._by_runner:
            return
        chunk = LiveLog(
            **self._ids(),
            seq=self._next(stream),
            stream=stream,
            text=text,
            offset=self.offset,
        )
        self.offset += len(text.encode("utf-8"))
        await self._pub.publish_nowait(chunk)

    async def trace(self, events: Sequence[TraceEvent]) -> None:
        if self._by_runner or not events:
            return
        await self._pub.publish_nowait(
            LiveTrace(
                **self._ids(),
                seq=self._next("trace"),
                events=tuple(events),
            )
        )

    async def infra(self, marks: Sequence[Infra]) -> None:
        if not marks:
            return
        await self._pub.publish_nowait(
            InfraMark(
                **self._ids(),
                seq=self._next("infra"),
                mark=marks[0],
                more=tuple(marks[1:]),
            )
        )

    async def placement(self, sample: PlacementSample) -> None:
        await self._pub.publish_nowait(
            LivePlacement(
                **self._ids(),
                seq=self._next("placement"),
                sample=sample,
            )
        )
