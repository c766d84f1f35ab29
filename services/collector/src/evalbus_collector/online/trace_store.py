"""The I/O of trace assembly (`assembly` holds the rules): the stream's view of one trace, the record
of traces already assembled, and the bus's clock.

- `TraceStore.batches(subject)` reads every span batch stored on a trace's subject in the
  `OBSERVATIONS` stream (message gets by subject, in stream order), with the time JetStream stored
  each — whichever replica holds them. `TraceStore.count(subject)` first asks how many there are
  (one stream-info request): usually only the batches this replica holds, which it need not read.
- `TraceStore.record` / `assembled`: the `ONLINE_TRACES` key-value bucket, one key per trace holding
  the last stream sequence its observation includes. Written with a create (compare-and-set): the
  first record stands. Kept as long as the observation's dedup window (`OBSERVATIONS`'
  `duplicate_window_s`), so a trace whose observation is still deduplicated is still known.
- `BusClock`: JetStream's time, as this replica estimates it (the server's `ts` in a stream-info
  answer, against the midpoint of the request; again every 30 s). Assembly and the online delay
  compare the server's timestamps with it, so neither the application's nor a replica's clock
  decides when a trace is whole or an observation due.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import msgspec
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from evalbus_collector.online.assembly import NS, StoredBatch
from evalbus_contracts import DecodeError, ObservationSpans, decode_event
from evalbus_contracts.streams import OBSERVATIONS, KvDef
from evalbus_runtime.bus import open_bucket

log = logging.getLogger("evalbus.collector.assembly")

TRACES_BUCKET = KvDef(bucket="ONLINE_TRACES", ttl_s=OBSERVATIONS.duplicate_window_s, history=1, max_value_size=64)
"""Assembled traces: key `<service digest>.<trace id>`, value the last stream sequence included."""
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class TraceStoreUnavailableError(RuntimeError):
    """The stream or the record could not be read or written (the batch is retried)."""


def datetime_ns(moment: datetime) -> int:
    """`moment` as Unix nanoseconds (exact to its microseconds)."""
    return (moment - _EPOCH) // timedelta(microseconds=1) * 1000


def rfc3339_ns(text: str) -> int:
    """An RFC 3339 UTC time with up to nanoseconds (`2026-12-01T15:25:57.94966555Z`) as Unix ns."""
    if not text.endswith("Z"):
        return datetime_ns(datetime.fromisoformat(text))
    base, _, fraction = text[:-1].partition(".")
    whole = datetime.fromisoformat(base).replace(tzinfo=UTC)
    return (whole - _EPOCH) // timedelta(seconds=1) * NS + int((fraction + "0" * 9)[:9])


class _State(msgspec.Struct, frozen=True):
    subjects: dict[str, int] = msgspec.field(default_factory=dict)


class _SubjectCounts(msgspec.Struct, frozen=True):
    """The part of a stream-info answer `TraceStore.count` reads."""

    state: _State = msgspec.field(default_factory=_State)
    error: dict[str, object] | None = None


def _key(target: str, trace_id: str) -> str:
    # keys allow few characters: the service is named by a digest
    return f"{hashlib.sha256(target.encode()).hexdigest()[:16]}.{trace_id}"


class TraceStore:
    """A trace's batches in the stream, and the record of assembled traces."""

    def __init__(self, stream: str = OBSERVATIONS.name) -> None:
        self._stream = stream
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None

    async def start(self, nc: NatsClient, js: JetStreamContext, replicas: int = 1) -> None:
        """Open the record bucket (created with `replicas` replicas when missing)."""
        self._nc = nc
        self._js = js
        self._kv = await open_bucket(js, TRACES_BUCKET, replicas)

    async def batches(self, subject: str) -> list[StoredBatch]:
        """Every span batch stored on `subject`, in stream order (what cannot be decoded is left to
        its own delivery, which dead-letters it)."""
        if self._js is None:
            raise TraceStoreUnavailableError("the trace store is not open")
        out: list[StoredBatch] = []
        seq = 0
        while True:
            try:
                msg = await self._js.get_msg(self._stream, seq=seq, subject=subject, next=True)
            except NotFoundError:
                return out
            except Exception as e:
                raise TraceStoreUnavailableError(f"reading {subject}: {e}") from e
            if msg.seq is None:
                return out
            seq = msg.seq + 1
            try:
                event = decode_event(msg.data or b"")
            except (DecodeError, ValueError):
                continue
            if isinstance(event, ObservationSpans) and msg.time is not None:
                out.append(StoredBatch(seq=msg.seq, stored_ns=datetime_ns(msg.time), batch=event))

    async def count(self, subject: str) -> int:
        """How many messages the stream holds on `subject` (one stream-info request: when it is the
        number of batches this replica holds, they are the whole view and need not be read)."""
        if self._nc is None:
            raise TraceStoreUnavailableError("the trace store is not open")
        request = msgspec.json.encode({"subjects_filter": subject})
        try:
            answer = await self._nc.request(f"$JS.API.STREAM.INFO.{self._stream}", request, timeout=5)
            info = msgspec.json.decode(answer.data, type=_SubjectCounts)
        except Exception as e:
            raise TraceStoreUnavailableError(f"counting {subject}: {e}") from e
        if info.error is not None:
            raise TraceStoreUnavailableError(f"counting {subject}: {info.error}")
        return info.state.subjects.get(subject, 0)

    async def assembled(self, target: str, trace_id: str) -> int | None:
        """The last stream sequence of the trace's stored observation, when it is recorded."""
        if self._kv is None:
            raise TraceStoreUnavailableError("the trace record is not open")
        try:
            entry = await self._kv.get(_key(target, trace_id))
        except KeyNotFoundError:
            return None
        except Exception as e:
            raise TraceStoreUnavailableError(f"reading the record of {trace_id}: {e}") from e
        return int(entry.value or b"0")

    async def record(self, target: str, trace_id: str, last_seq: int) -> int:
        """Record that the trace's observation includes its batches up to `last_seq`, unless one is
        recorded already; the record that stands."""
        if self._kv is None:
            raise TraceStoreUnavailableError("the trace record is not open")
        try:
            await self._kv.create(_key(target, trace_id), str(last_seq).encode())
        except KeyWrongLastSequenceError:
            standing = await self.assembled(target, trace_id)
            return last_seq if standing is None else standing
        except Exception as e:
            raise TraceStoreUnavailableError(f"recording {trace_id}: {e}") from e
        return last_seq


class BusClock:
    """JetStream's time as this replica estimates it: the local clock corrected by the offset last
    measured against the server."""

    def __init__(self, local: Callable[[], int] = time.time_ns) -> None:
        self._local = local
        self.offset_ns = 0
        """Local clock minus the server's (positive: this replica's clock is ahead)."""

    def now_ns(self) -> int:
        """The server's time now, Unix nanoseconds."""
        return self._local() - self.offset_ns

    async def calibrate(self, nc: NatsClient, stream: str = OBSERVATIONS.name) -> None:
        """Measure the offset from a stream-info answer's `ts` (the server's time when it answered)."""
        before = self._local()
        answer = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=5)
        after = self._local()
        stamp = json.loads(answer.data).get("ts")
        if isinstance(stamp, str):
            self.offset_ns = (before + after) // 2 - rfc3339_ns(stamp)

    async def run(self, nc: NatsClient, period_s: float = 30.0) -> None:
        """Calibrate every `period_s` (until cancelled)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.calibrate(nc)
            except Exception as e:  # the last offset stays; the next period tries again
                log.warning("bus clock not calibrated: %s", e)
