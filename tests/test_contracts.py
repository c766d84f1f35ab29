"""Contracts: every event round-trips through JSON, unknown fields are ignored on decode, the subject
token encoding is reversible and subject-safe, and every event's subject lands in exactly one stream
and reaches exactly the consumers meant to read it.

Strategies are derived from msgspec's own view of the types (`msgspec.inspect`) rather than
`hypothesis.strategies.from_type`: `from_type` cannot see that JSON has no NaN or infinity, that
tagged unions need their tag, or that fields are renamed on the wire (`class`, `pass`, `schema`,
`subject`). Deriving from the type info also covers any event or field added later.
"""

from __future__ import annotations

import re
from datetime import UTC
from functools import cache
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from evalbus_contracts import (
    CONSUMERS,
    EVENT_TYPES,
    STREAMS,
    CaseRequested,
    ComputeSpec,
    InvalidIdError,
    OnlineSuiteApplied,
    decode,
    decode_event,
    decode_token,
    encode,
    encode_token,
    lane_consumer,
    subjects,
    to_builtins,
)
from evalbus_contracts.codec import NewerSchemaError
from evalbus_contracts.events import Event, EventBase
from evalbus_contracts.streams import DISPATCHER_CASES

pytestmark = pytest.mark.unit

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)

# ---------------------------------------------------------------- strategies from msgspec type info

_JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10)
)
_JSON = st.recursive(
    _JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
"""Any JSON value (for `Any` fields); arrays decode as lists, so only lists are generated."""


def _int_bounds(t: mi.IntType) -> tuple[int, int]:
    low = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**63))
    high = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**63 - 1)
    return low, high


def strategy(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values of the type msgspec describes as `t`, limited to what JSON carries."""
    if isinstance(t, mi.StructType):
        return _struct_strategy(t.cls)
    if isinstance(t, mi.UnionType):
        return st.one_of(*[strategy(x) for x in t.types])
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.IntType):
        low, high = _int_bounds(t)
        return st.integers(low, high)
    if isinstance(t, mi.FloatType):
        floor, ceiling = (t.ge if t.ge is not None else t.gt), (t.le if t.le is not None else t.lt)
        return st.floats(
            min_value=floor,
            max_value=ceiling,
            allow_nan=False,
            allow_infinity=False,
            exclude_min=t.ge is None and t.gt is not None,
            exclude_max=t.le is None and t.lt is not None,
        )
    if isinstance(t, mi.StrType):
        if t.pattern is not None:
            longest = t.max_length or 64
            return st.from_regex(t.pattern, fullmatch=True).filter(lambda s: len(s) <= longest)
        return st.text(max_size=12)
    if isinstance(t, mi.DateTimeType):
        return st.datetimes(timezones=st.just(UTC))
    if isinstance(t, mi.DictType):
        return st.dictionaries(strategy(t.key_type), strategy(t.value_type), max_size=3)
    if isinstance(t, mi.VarTupleType):
        return st.lists(strategy(t.item_type), max_size=3).map(tuple)
    if isinstance(t, mi.ListType):
        return st.lists(strategy(t.item_type), max_size=3)
    if isinstance(t, mi.TupleType):
        return st.tuples(*[strategy(x) for x in t.item_types])
    if isinstance(t, mi.AnyType):
        return _JSON
    raise TypeError(f"no strategy for {t!r}: extend tests/test_contracts.py")


@cache
def _struct_strategy(cls: type[msgspec.Struct]) -> st.SearchStrategy[Any]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    required = {f.name: _field_strategy(f) for f in info.fields if f.required}
    optional = {f.name: _field_strategy(f) for f in info.fields if not f.required}
    return st.fixed_dictionaries(required, optional=optional).map(lambda kw: cls(**kw))


def _field_strategy(f: mi.Field) -> st.SearchStrategy[Any]:
    # Deferred, so a type is only expanded when drawn.
    return st.deferred(lambda: strategy(f.type))


def events_of(kind: type[EventBase]) -> st.SearchStrategy[EventBase]:
    """Arbitrary events of one type, of a schema version this code knows (a newer one is refused:
    `test_a_newer_schema_version_is_refused`)."""
    known = st.integers(min_value=1, max_value=kind.SCHEMA_VERSION)
    return st.builds(lambda event, v: replace(event, v=v), _struct_strategy(kind), known)


@pytest.mark.parametrize("kind", EVENT_TYPES, ids=lambda k: str(k.__struct_config__.tag))
@SETTINGS
@given(data=st.data(), ahead=st.integers(min_value=1, max_value=1000))
def test_a_newer_schema_version_is_refused(kind: type[EventBase], data: st.DataObject, ahead: int) -> None:
    doc = to_builtins(data.draw(events_of(kind)))
    doc["v"] = kind.SCHEMA_VERSION + ahead
    with pytest.raises(NewerSchemaError, match=f"{kind.__struct_config__.tag} schema version"):
        decode_event(encode(doc))


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("kind", EVENT_TYPES, ids=lambda k: str(k.__struct_config__.tag))
@SETTINGS
@given(data=st.data())
def test_every_event_round_trips(kind: type[EventBase], data: st.DataObject) -> None:
    event = data.draw(events_of(kind))
    raw = encode(event)
    assert decode_event(raw) == event
    assert decode(raw, kind) == event
    assert msgspec.json.decode(raw)["type"] == kind.__struct_config__.tag


def test_every_event_type_is_covered() -> None:
    """The union decoded by `decode_event` and `EVENT_TYPES` agree (so the round trip covers all)."""
    tags = {k.__struct_config__.tag for k in EVENT_TYPES}
    assert len(tags) == len(EVENT_TYPES)
    union = mi.type_info(Event)
    assert isinstance(union, mi.UnionType)
    assert {t.cls for t in union.types if isinstance(t, mi.StructType)} == set(EVENT_TYPES)


# ---------------------------------------------------------------- unknown fields


def _with_unknown_fields(value: Any, t: mi.Type, marker: Any) -> Any:
    """`value` (builtins) with an unknown key added to every object that is a Struct, at any depth."""
    if isinstance(t, mi.StructType):
        assert isinstance(value, dict)
        out = {}
        for f in t.fields:
            if f.encode_name in value:
                out[f.encode_name] = _with_unknown_fields(value[f.encode_name], f.type, marker)
        for key in value:  # the tag
            out.setdefault(key, value[key])
        out["x_unknown_field"] = marker
        return out
    if isinstance(t, mi.UnionType):
        for member in t.types:
            if _matches(value, member):
                return _with_unknown_fields(value, member, marker)
        return value
    if isinstance(t, (mi.VarTupleType, mi.ListType)):
        return [_with_unknown_fields(v, t.item_type, marker) for v in value]
    if isinstance(t, mi.TupleType):
        return [_with_unknown_fields(v, it, marker) for v, it in zip(value, t.item_types, strict=True)]
    if isinstance(t, mi.DictType):
        return {k: _with_unknown_fields(v, t.value_type, marker) for k, v in value.items()}
    return value


def _matches(value: Any, t: mi.Type) -> bool:
    if isinstance(t, mi.StructType):
        if not isinstance(value, dict):
            return False
        if t.tag_field is None:
            return True
        return bool(value.get(t.tag_field) == t.tag)
    if isinstance(t, mi.NoneType):
        return value is None
    return False


@pytest.mark.parametrize("kind", EVENT_TYPES, ids=lambda k: str(k.__struct_config__.tag))
@SETTINGS
@given(data=st.data(), marker=_JSON)
def test_unknown_fields_are_ignored(kind: type[EventBase], data: st.DataObject, marker: Any) -> None:
    event = data.draw(events_of(kind))
    extended = _with_unknown_fields(to_builtins(event), mi.type_info(kind), marker)
    assert "x_unknown_field" in extended
    assert decode_event(encode(extended)) == event


# ---------------------------------------------------------------- token encoding

_SUBJECT_UNSAFE = re.compile(r"[.*>\s]")
_TRICKY_IDS = [
    "a.b",
    "with space",
    "star*",
    "gt>",
    ">",
    "*",
    "tab\tnewline\n",
    "ünïcødé-日本",
    "emoji-🙂",
    "~7E",
    "~",
    "~~",
    "plain-ID_123",
    "\u00a0nbsp",
    "\u2028line-sep",
    "nul\x00",
]


@pytest.mark.parametrize("raw_id", _TRICKY_IDS)
def test_token_encoding_handles_tricky_ids(raw_id: str) -> None:
    token = encode_token(raw_id)
    assert decode_token(token) == raw_id
    assert not _SUBJECT_UNSAFE.search(token)
    assert token.isascii()


@SETTINGS
@given(raw_id=st.text(min_size=1))
def test_token_encoding_is_reversible_and_subject_safe(raw_id: str) -> None:
    token = encode_token(raw_id)
    assert decode_token(token) == raw_id
    assert token
    assert not _SUBJECT_UNSAFE.search(token), token
    assert re.fullmatch(r"[A-Za-z0-9_~-]+", token), token


@SETTINGS
@given(a=st.text(min_size=1), b=st.text(min_size=1))
def test_distinct_ids_give_distinct_tokens(a: str, b: str) -> None:
    assert (encode_token(a) == encode_token(b)) == (a == b)


@SETTINGS
@given(raw_id=st.text(alphabet="abcXYZ019_-", min_size=1))
def test_plain_ids_stay_readable(raw_id: str) -> None:
    assert encode_token(raw_id) == raw_id


def test_empty_id_is_rejected() -> None:
    with pytest.raises(InvalidIdError):
        encode_token("")
    with pytest.raises(InvalidIdError):
        decode_token("")


@pytest.mark.parametrize("token", ["a.b", "~", "~4", "~zz", "~41", "a b", "é", "~FF"])
def test_tokens_it_could_not_have_produced_are_rejected(token: str) -> None:
    with pytest.raises(InvalidIdError):
        decode_token(token)


# ---------------------------------------------------------------- subjects against stream filters


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS server semantics: tokens split on `.`; `*` matches exactly one token; `>` (last token
    only) matches one or more remaining tokens."""
    p_tokens, s_tokens = pattern.split("."), subject.split(".")
    for i, p in enumerate(p_tokens):
        if p == ">":
            return i == len(p_tokens) - 1 and len(s_tokens) > i
        if i >= len(s_tokens):
            return False
        if p not in ("*", s_tokens[i]):
            return False
    return len(p_tokens) == len(s_tokens)


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("case.>", "case.executed.b.c", True),
        ("case.>", "case", False),
        ("case.*", "case.executed", True),
        ("case.*", "case.executed.b", False),
        ("run.*.live.>", "run.r1.live.log", True),
        ("run.*.live.>", "run.r1.live", False),
        ("batch.requested.>", "batch.requested.b1", True),
        ("batch.requested.>", "batch.cancelled.b1", False),
        ("a.b", "a.b", True),
        ("a.b", "a.b.c", False),
    ],
)
def test_subject_matcher(pattern: str, subject: str, expected: bool) -> None:
    assert subject_matches(pattern, subject) is expected


def assert_valid_subject(subject: str) -> None:
    """A subject a publisher may use: non-empty tokens, no wildcard, no whitespace."""
    tokens = subject.split(".")
    assert all(tokens), subject
    assert not any(t in ("*", ">") or re.search(r"\s|[*>]", t) for t in tokens), subject


_RECORDER = "gateway-recorder"
EXPECTED_CONSUMERS: dict[str, set[str]] = {
    "batch.requested": {"dispatcher-batches", _RECORDER},
    "batch.cancelled": {_RECORDER},
    "batch.finalized": {_RECORDER},
    "case.requested": {"dispatcher-cases", _RECORDER},
    "case.executed": {"collector-cases", "judge-cases", _RECORDER},
    "case.collected": {"judge-cases", _RECORDER},
    "case.judged": {"exporter-cases", _RECORDER},
    "case.exported": {_RECORDER},
    "case.observed": {"judge-cases", _RECORDER},
    "live.log": set(),
    "live.trace": set(),
    "live.infra": set(),
    "live.placement": set(),
    "obs.received": {"collector-observations"},
    "obs.spans": {"collector-spans"},
    "online.suite.applied": {_RECORDER},
    "online.suite.deleted": {_RECORDER},
    "online.fate": {_RECORDER},
    "suite.baseline.set": {_RECORDER},
    "dlq": {"collector-dead-letters"},
}
"""Which durable consumers must receive each event type: no more, no fewer."""

EXPECTED_STREAM: dict[str, str] = {
    **dict.fromkeys([t for t in EXPECTED_CONSUMERS if t.startswith(("batch.", "case.", "online.", "suite."))], "CASES"),
    **dict.fromkeys(["live.log", "live.trace", "live.infra", "live.placement"], "LIVE"),
    "obs.received": "OBSERVATIONS",
    "obs.spans": "OBSERVATIONS",
    "dlq": "DLQ",
}

_IDS = st.text(min_size=1, max_size=16)


def _with_ids(event: EventBase, data: st.DataObject) -> EventBase:
    """`event` with arbitrary non-empty ids everywhere its subject reads one."""
    ids: dict[str, Any] = {
        "batch_id": data.draw(_IDS),
        "case_id": data.draw(_IDS),
        "run_id": data.draw(_IDS),
    }
    for name in ("suite_id", "observation_id", "target", "service", "trace_id"):
        if name in type(event).__struct_fields__:
            ids[name] = data.draw(_IDS)
    if isinstance(event, OnlineSuiteApplied):
        ids["suite"] = replace(event.suite, id=data.draw(_IDS))
    return replace(event, **ids)


def test_expectations_cover_every_event() -> None:
    assert set(EXPECTED_CONSUMERS) == {str(k.__struct_config__.tag) for k in EVENT_TYPES}


def test_streams_do_not_overlap() -> None:
    """JetStream refuses overlapping stream subjects; a subject must have exactly one home."""
    for i, a in enumerate(STREAMS):
        for b in STREAMS[i + 1 :]:
            for pa in a.subjects:
                for pb in b.subjects:
                    probe_a = pa.replace("*", "x").replace(">", "x")
                    probe_b = pb.replace("*", "x").replace(">", "x")
                    assert not subject_matches(pb, probe_a), (a.name, pa, b.name, pb)
                    assert not subject_matches(pa, probe_b), (a.name, pa, b.name, pb)


def test_consumers_read_subjects_of_their_stream() -> None:
    streams = {s.name: s for s in STREAMS}
    for consumer in CONSUMERS:
        stream = streams[consumer.stream]
        for f in consumer.filter_subjects:
            probe = f.replace("*", "x").replace(">", "x")
            assert any(subject_matches(s, probe) for s in stream.subjects), (consumer.durable, f)


@pytest.mark.parametrize("kind", EVENT_TYPES, ids=lambda k: str(k.__struct_config__.tag))
@SETTINGS
@given(data=st.data())
def test_event_subject_lands_in_its_stream_and_consumers(kind: type[EventBase], data: st.DataObject) -> None:
    event = _with_ids(data.draw(events_of(kind)), data)
    subject = event.subject()
    assert_valid_subject(subject)
    homes = [s.name for s in STREAMS if any(subject_matches(p, subject) for p in s.subjects)]
    assert homes == [EXPECTED_STREAM[event.type]], (subject, homes)
    consumers = CONSUMERS
    expected = EXPECTED_CONSUMERS[event.type]
    if isinstance(event, CaseRequested):  # its lane's consumer takes it, whatever the lane
        lane = lane_consumer(event.lane)
        consumers = (*CONSUMERS, lane) if lane not in CONSUMERS else CONSUMERS
        expected = (expected - {DISPATCHER_CASES.durable}) | {lane.durable}
    readers = {c.durable for c in consumers if any(subject_matches(f, subject) for f in c.filter_subjects)}
    assert readers == expected, (subject, readers)
    for consumer in consumers:
        if consumer.durable in readers:
            assert consumer.stream == homes[0]


@SETTINGS
@given(data=st.data(), other=_IDS)
def test_batch_filter_selects_exactly_one_batch(data: st.DataObject, other: str) -> None:
    kind = data.draw(
        st.sampled_from(
            [
                k
                for k in EVENT_TYPES
                if EXPECTED_STREAM[str(k.__struct_config__.tag)] == "CASES"
                and k.__struct_config__.tag != "case.observed"
                and not str(k.__struct_config__.tag).startswith(("online.", "suite."))
            ]
        )
    )
    event = _with_ids(data.draw(events_of(kind)), data)
    assert event.batch_id is not None
    mine = subjects.batch_filter(event.batch_id)
    assert any(subject_matches(f, event.subject()) for f in mine)
    if other != event.batch_id:
        theirs = subjects.batch_filter(other)
        assert not any(subject_matches(f, event.subject()) for f in theirs)


@SETTINGS
@given(run_id=_IDS, other=_IDS, channel=st.sampled_from(["log", "trace", "infra"]))
def test_live_filter_selects_exactly_one_run(run_id: str, other: str, channel: str) -> None:
    subject = subjects.live_subject(run_id, channel)
    assert subject_matches(subjects.live_filter(run_id), subject)
    assert subject_matches(subjects.live_filter(other), subject) == (other == run_id)


def test_a_compute_spec_with_the_default_network_encodes_as_before() -> None:
    """`network` is a field with a default: a spec that keeps it encodes without the key (an older
    gateway still takes it), `none` round-trips, and a value outside the set is refused."""
    assert b"network" not in encode(ComputeSpec(cpu=2))
    offline = ComputeSpec(network="none")
    assert msgspec.json.decode(encode(offline), type=ComputeSpec) == offline
    with pytest.raises(msgspec.ValidationError, match="network"):
        msgspec.json.decode(b'{"network": "offline"}', type=ComputeSpec)
