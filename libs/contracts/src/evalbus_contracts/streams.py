"""Stream and consumer definitions as data: created idempotently by the runtime at start.

Global limits live here as `max_ack_pending`, which JetStream enforces across all replicas:
four cases judged at once and two exported at once, whatever the number of replicas.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from evalbus_contracts.subjects import DEFAULT_LANE, lane_filter, subject_matches


class StreamDef(msgspec.Struct, frozen=True, kw_only=True):
    """A JetStream stream."""

    name: str
    """Stream name."""
    subjects: tuple[str, ...]
    """Subjects it captures."""
    retention: Literal["limits", "workqueue", "interest"] = "limits"
    """Retention policy."""
    max_age_s: float = 0.0
    """Oldest message kept, seconds (0: forever)."""
    max_msgs_per_subject: int = -1
    """Ring size per subject (-1: unlimited)."""
    duplicate_window_s: float = 3600.0
    """`Nats-Msg-Id` deduplication window, seconds."""
    max_msg_size: int = -1
    """Largest message accepted (-1: server limit)."""


class ConsumerDef(msgspec.Struct, frozen=True, kw_only=True):
    """A shared durable pull consumer; every replica of a service binds to the same one."""

    durable: str
    """Durable name."""
    stream: str
    """Stream it reads."""
    filter_subjects: tuple[str, ...]
    """Subjects it receives."""
    ack_wait_s: float = 10.0
    """Redelivery after this long without ack or `in_progress`: how long the messages a dead
    replica held wait before another replica gets them. Healthy replicas send `in_progress` every
    quarter of it, so it can be short; 10 s bounds the stall after a crash (issue 13's goal), and
    an exclusive stage (the case stages) can go shorter still."""
    max_deliver: int = 5
    """Deliveries before the message is given up (and copied to the DLQ)."""
    max_ack_pending: int = 1000
    """Unacknowledged messages across all replicas: the global concurrency limit."""
    backoff_s: tuple[float, ...] = ()
    """Redelivery delays after ack-wait expiries (JetStream `backoff`)."""


class KvDef(msgspec.Struct, frozen=True, kw_only=True):
    """A JetStream key-value bucket (a stream underneath): shared state every replica reads."""

    bucket: str
    """Bucket name."""
    ttl_s: float
    """An entry not written again for this long is removed."""
    history: int = 1
    """Revisions kept per key."""
    max_value_size: int = -1
    """Largest value accepted, bytes (-1: server limit)."""


class ObjectBucketDef(msgspec.Struct, frozen=True, kw_only=True):
    """A JetStream object store bucket (a stream underneath, `OBJ_<bucket>`): payloads too large for
    an event, which the event names by `ObjectRef`."""

    bucket: str
    """Bucket name."""
    ttl_s: float = 0.0
    """Oldest object kept, seconds (0: forever, as long as the event store keeps the events that
    name it)."""
    chunk_size: int = 128 * 1024
    """Bytes per chunk message written: well under a stock nats-server's 1 MB `max_payload`."""
    description: str = ""
    """What the bucket holds (shown by `nats object ls`)."""


CASES = StreamDef(name="CASES", subjects=("batch.>", "case.>", "online.>", "suite.>"), duplicate_window_s=120.0)
"""The event log: every event of a batch until a minute after it is finalized and the event store
holds them all (the gateway's compactor then purges them; the store is the record for ever). Its
duplicate window is 2 minutes, not the hour it once
was: nats-server keeps every id inside the window in RAM (about 200 bytes each,
`bench/nats_memory.py`), and the window only has to cover a publish retried and a redelivery that
overlaps a slow first delivery. A redelivery later than that finds its output on the stream
instead (`Publisher.publish_missing`, the consumer loop's `settled_by`)."""
LIVE = StreamDef(
    name="LIVE", subjects=("run.*.live.>",), max_age_s=15 * 60.0, max_msgs_per_subject=2000, duplicate_window_s=120.0
)
"""The live ring: output, marks, trace events and samples of runs (15 minutes, 2,000 messages per
run and channel); a settled run's are purged by the dispatcher that ran it, 2 minutes after it
settled (`evalbus_dispatcher.live_purge`)."""
OBSERVATIONS = StreamDef(
    name="OBSERVATIONS", subjects=("obs.>",), retention="workqueue", max_age_s=24 * 3600.0, duplicate_window_s=3600.0
)
DLQ = StreamDef(name="DLQ", subjects=("dlq.>",), duplicate_window_s=120.0)

STREAMS: tuple[StreamDef, ...] = (CASES, LIVE, OBSERVATIONS, DLQ)


def stream_of(subject: str) -> StreamDef | None:
    """The stream that captures `subject` (None: no stream does)."""
    for stream in STREAMS:
        if any(subject_matches(pattern, subject) for pattern in stream.subjects):
            return stream
    return None


DISPATCHER_BATCHES = ConsumerDef(
    durable="dispatcher-batches",
    stream="CASES",
    filter_subjects=("batch.requested.>",),
    max_ack_pending=64,
    ack_wait_s=4.0,
)
"""The fan-out: exclusive like the case stages (one fan-out of a batch at a time), so a killed
dispatcher's fan-out is taken up 2.5–4 s later."""
DISPATCHER_CASES = ConsumerDef(
    durable="dispatcher-cases",
    stream="CASES",
    filter_subjects=("case.requested.*.*",),
    max_ack_pending=1000,
    ack_wait_s=4.0,
)
"""The default lane's requests (`case.requested.<batch>.<case>`, every request written before lanes
existed); each other lane has its own consumer (`lane_consumer`). Its `ack_wait` is 4 s: the cases a
killed dispatcher held run again 2.5–4 s later. A healthy replica whose event loop stalls past it is
not joined by a second run of the agent — the dispatcher's case stage is exclusive
(`evalbus_runtime.Stage.exclusive`), so the redelivery is left to the replica still holding it."""


def lane_consumer(lane: str) -> ConsumerDef:
    """The shared consumer of one lane's requests: `dispatcher-cases` for the default lane,
    `dispatcher-cases-<lane>` (filtered on `case.requested.*.*.<lane>`) for any other. Every replica
    serving the lane binds to it, as the default lane's replicas share `dispatcher-cases`."""
    if lane == DEFAULT_LANE:
        return DISPATCHER_CASES
    return msgspec.structs.replace(
        DISPATCHER_CASES, durable=f"{DISPATCHER_CASES.durable}-{lane}", filter_subjects=(lane_filter(lane),)
    )


COLLECTOR_CASES = ConsumerDef(
    durable="collector-cases",
    stream="CASES",
    filter_subjects=("case.executed.>",),
    max_ack_pending=256,
    ack_wait_s=4.0,
)
COLLECTOR_OBSERVATIONS = ConsumerDef(
    durable="collector-observations",
    stream="OBSERVATIONS",
    filter_subjects=("obs.received.>",),
    max_ack_pending=1024,
)
COLLECTOR_SPANS = ConsumerDef(
    durable="collector-spans",
    stream="OBSERVATIONS",
    filter_subjects=("obs.spans.>",),
    max_ack_pending=100_000,
    max_deliver=10,
    ack_wait_s=30.0,
)
"""Span batches held (unacknowledged, kept alive by `in_progress`) until their trace is assembled."""
COLLECTOR_DEAD_LETTERS = ConsumerDef(
    durable="collector-dead-letters", stream="DLQ", filter_subjects=("dlq.>",), max_ack_pending=256
)
"""Dead letters, read for the observations among them (their fate becomes `dead_lettered`)."""
JUDGE_CASES = ConsumerDef(
    durable="judge-cases",
    stream="CASES",
    filter_subjects=("case.executed.>", "case.collected.>", "case.observed.>"),
    max_ack_pending=4,
    ack_wait_s=4.0,
)
EXPORTER_CASES = ConsumerDef(
    durable="exporter-cases", stream="CASES", filter_subjects=("case.judged.>",), max_ack_pending=2, ack_wait_s=4.0
)
"""The case stages after the dispatcher's (`collector-cases`, `judge-cases`, `exporter-cases`) are
exclusive too (`evalbus_runtime.Stage.exclusive`: no second model judgement, trace pull or sink
write beside a stalled first one), so their `ack_wait` is 4 s like the dispatcher's case requests:
what a killed replica held runs again 2.5–4 s later."""
GATEWAY_RECORDER = ConsumerDef(
    durable="gateway-recorder",
    stream="CASES",
    filter_subjects=("batch.>", "case.>", "online.>", "suite.>"),
    max_ack_pending=20000,
)

DISPATCHERS = KvDef(bucket="dispatchers", ttl_s=60.0, max_value_size=256 * 1024)
"""Every dispatcher replica's `DispatcherStatus` (key: its id), written every few seconds and
deleted when it stops; one that died ages out (readers also drop a status older than three of its
intervals)."""
TERMINAL_TICKETS = KvDef(bucket="terminal-tickets", ttl_s=120.0, max_value_size=4 * 1024)
"""Single-use terminal tickets (key: the SHA-256 of the ticket, never the ticket), valid 30 s;
consuming one is an atomic delete at its revision, so a ticket works once on any gateway replica."""

SUPERSEDE_KEYS = KvDef(bucket="supersede-keys", ttl_s=3600.0, max_value_size=1024)
"""The latest batch submitted with each supersede key (key: the SHA-256 of the submitter and the
supersede key), written with compare-and-set by the gateway that accepted it. Two submissions a few
milliseconds apart find each other here before either is recorded in the read model, so the later
one always supersedes the earlier, whichever gateway replica took each. An hour is far longer than
the recorder ever lags; after it the read model answers."""

BUCKETS: tuple[KvDef, ...] = (DISPATCHERS, TERMINAL_TICKETS, SUPERSEDE_KEYS)

DATASETS = ObjectBucketDef(bucket="datasets", description="evalbus: uploaded datasets (JSONL of cases)")
"""Datasets uploaded through `POST /v1/datasets`; a `batch.requested` names one by `ObjectRef`. No
TTL: the event store keeps every `batch.requested` forever, and a re-judge or a replay may read its
dataset again, so an object lives as long as the events that name it (an operator who trims old
batches deletes their objects with them)."""
ARTIFACTS = ObjectBucketDef(bucket="artifacts", description="evalbus: large stdout, traces and artifacts of runs")
"""Payloads of runs above the inline threshold; no TTL for the same reason as `DATASETS` (a sealed
trajectory's hash covers their digests)."""

OBJECT_BUCKETS: tuple[ObjectBucketDef, ...] = (DATASETS, ARTIFACTS)

CONSUMERS: tuple[ConsumerDef, ...] = (
    DISPATCHER_BATCHES,
    DISPATCHER_CASES,
    COLLECTOR_CASES,
    COLLECTOR_OBSERVATIONS,
    COLLECTOR_SPANS,
    COLLECTOR_DEAD_LETTERS,
    JUDGE_CASES,
    EXPORTER_CASES,
    GATEWAY_RECORDER,
)


def max_deliveries_advisory(consumer: ConsumerDef) -> str:
    """Advisory subject JetStream publishes when a message of `consumer` exhausts `max_deliver`."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{consumer.stream}.{consumer.durable}"
