"""Every payload evalbus ever wrote stays readable: `tests/fixtures/events/<type>.v<n>.json` holds
one event of each type as first written (captured from a real pipeline run where one produces the
type), and is decoded by today's code forever. Never edit or regenerate a fixture; when a type's
schema version rises, add `<type>.v<n+1>.json` beside the old one and the upcast that reads it
(`evalbus_contracts.codec.upcast`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import msgspec
import pytest

from evalbus_contracts import Event, decode_event
from evalbus_contracts import codec as codec_module
from evalbus_contracts.codec import NewerSchemaError, upcast
from evalbus_contracts.events import SuiteBaselineSet

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "events"
TYPES = {str(cls.__struct_config__.tag): cls for cls in get_args(Event)}


def fixtures() -> list[Path]:
    return sorted(FIXTURES.glob("*.json"))


def test_every_event_type_has_a_fixture_of_its_first_version() -> None:
    names = {p.name for p in fixtures()}
    assert sorted(t for t in TYPES if f"{t}.v1.json" not in names) == []
    assert sorted(n for n in names if n.rsplit(".v", 1)[0] not in TYPES) == []


def test_every_event_class_writes_the_version_it_knows() -> None:
    # raising SCHEMA_VERSION without the `v` default would write new payloads as the old version
    stale = {
        t: (cls.SCHEMA_VERSION, cls.__struct_defaults__)
        for t, cls in TYPES.items()
        if _v_default(cls) != cls.SCHEMA_VERSION
    }
    assert stale == {}


def _v_default(cls: type[Any]) -> object:
    return next(f.default for f in msgspec.structs.fields(cls) if f.name == "v")


@pytest.mark.parametrize("path", fixtures(), ids=lambda p: p.name)
def test_a_fixture_decodes_to_its_type_and_keeps_its_data(path: Path) -> None:
    raw = path.read_bytes()
    doc = json.loads(raw)
    event = decode_event(raw)
    assert type(event) is TYPES[doc["type"]]
    assert event.v == type(event).SCHEMA_VERSION
    # what the old payload said is still what the event says: every field it carried is still a
    # field with the same value (fields a later release added appear with their defaults)
    assert lost(event, doc, "$") == []


def lost(obj: object, value: object, path: str) -> list[str]:
    """Where `value` (a fixture's JSON) is not what `obj` (today's decoding of it) holds."""
    if isinstance(obj, msgspec.Struct):
        if not isinstance(value, dict):
            return [f"{path}: {value!r} became a {type(obj).__name__}"]
        config = obj.__struct_config__
        names = dict(zip(obj.__struct_encode_fields__, obj.__struct_fields__, strict=True))
        out: list[str] = []
        for key, item in value.items():
            if key == config.tag_field:
                if item != config.tag:
                    out.append(f"{path}.{key}: {item!r} read as {config.tag!r}")
            elif key not in names:
                out.append(f"{path}.{key}: no such field any more (its value {item!r} is ignored)")
            elif not (key == "v" and path == "$"):
                out += lost(getattr(obj, names[key]), item, f"{path}.{key}")
        return out
    if isinstance(obj, tuple | list) and isinstance(value, list) and len(obj) == len(value):
        return [p for i, (o, v) in enumerate(zip(obj, value, strict=True)) for p in lost(o, v, f"{path}[{i}]")]
    if isinstance(obj, dict) and isinstance(value, dict) and obj.keys() == value.keys():
        return [p for k in value for p in lost(obj[k], value[k], f"{path}.{k}")]
    builtin = msgspec.to_builtins(obj)
    return [] if builtin == value else [f"{path}: {value!r} read as {builtin!r}"]


@pytest.fixture
def v2_baseline() -> Iterator[None]:
    """`suite.baseline.set` as if a release renamed `baseline` to `baseline_batch` at version 2
    (the test's own registered upcast; the class keeps its field name, the document shape is what
    changes)."""
    kind = SuiteBaselineSet
    saved = kind.SCHEMA_VERSION
    kind.SCHEMA_VERSION = 2
    try:
        yield
    finally:
        kind.SCHEMA_VERSION = saved
        codec_module.UPCASTS.pop(("suite.baseline.set", 1), None)


def test_an_older_version_is_read_through_its_upcast(v2_baseline: None) -> None:
    calls: list[int] = []

    @upcast("suite.baseline.set", 1)
    def _v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
        calls.append(doc["v"])
        doc["by"] = f"{doc['by']} (upcast)"
        return doc

    raw = (FIXTURES / "suite.baseline.set.v1.json").read_bytes()
    event = decode_event(raw)
    assert calls == [1]
    assert isinstance(event, SuiteBaselineSet)
    assert event.v == 2
    assert event.by == f"{json.loads(raw)['by']} (upcast)"
    # a payload at the current version is decoded as it is, without the chain
    current = json.loads(raw) | {"v": 2}
    same = decode_event(json.dumps(current).encode())
    assert isinstance(same, SuiteBaselineSet)
    assert same.by == json.loads(raw)["by"]
    assert calls == [1]


def test_an_older_shape_that_no_longer_validates_is_upcast_and_a_bad_payload_still_fails(v2_baseline: None) -> None:
    raw = json.loads((FIXTURES / "suite.baseline.set.v1.json").read_bytes())
    old_shape = {k: v for k, v in raw.items() if k != "baseline"} | {"base": raw["baseline"]}

    @upcast("suite.baseline.set", 1)
    def _rename(doc: dict[str, Any]) -> dict[str, Any]:
        doc["baseline"] = doc.pop("base")
        return doc

    event = decode_event(json.dumps(old_shape).encode())
    assert isinstance(event, SuiteBaselineSet)
    assert event.baseline == raw["baseline"]
    broken = {k: v for k, v in raw.items() if k != "baseline"} | {"v": 2}
    with pytest.raises(msgspec.ValidationError, match="baseline"):
        decode_event(json.dumps(broken).encode())
    with pytest.raises(NewerSchemaError, match="version 3 is newer"):
        decode_event(json.dumps(raw | {"v": 3}).encode())
