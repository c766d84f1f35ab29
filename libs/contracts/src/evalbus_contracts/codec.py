"""JSON encoders and decoders, built once per process (msgspec's fast path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, get_args

import msgspec

from evalbus_contracts.events import Event

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_event_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}

DecodeError = msgspec.DecodeError
"""Raised for bytes that are not a valid payload (includes validation errors)."""


def encode(value: Any) -> bytes:
    """Encode any contract value as JSON."""
    return _encoder.encode(value)


class NewerSchemaError(ValueError):
    """An event whose schema version is newer than this code knows: written by a newer release.
    Its reader cannot know what the new version means, so it refuses it (a dead letter with this
    reason) rather than guess."""


Upcast = Callable[[dict[str, Any]], dict[str, Any]]
"""A pure function from an event's JSON document at version n to the same event at n + 1."""

UPCASTS: dict[tuple[str, int], Upcast] = {}
"""`(event type, version n)` → the upcast from n to n + 1. A version step without one is additive
(new fields with defaults): the older document is read as it is."""

_EVENT_TYPES: dict[str, type[Any]] = {str(cls.__struct_config__.tag): cls for cls in get_args(Event)}


def upcast(event_type: str, from_version: int) -> Callable[[Upcast], Upcast]:
    """Register the upcast of `event_type` from `from_version` to the next version.

    Evolving an event: add fields with defaults (no new version needed: older readers ignore
    them, newer readers default them). For anything else — a rename, a changed meaning or shape —
    raise the class's `SCHEMA_VERSION` *and* its `v` default to n + 1 and register the pure
    function taking an n document to n + 1 here; readers apply the chain, so every payload ever
    written stays readable (`tests/fixtures/events/` holds one of each type as first written)."""

    def register(fn: Upcast) -> Upcast:
        UPCASTS[(event_type, from_version)] = fn
        return fn

    return register


def decode_event(data: bytes) -> Event:
    """Decode any event by its `type` tag; unknown fields are ignored, an older schema version is
    upcast to the current one, a newer one than the event type's `SCHEMA_VERSION` is refused
    (`NewerSchemaError`)."""
    try:
        event = _event_decoder.decode(data)
    except msgspec.ValidationError:
        return _decode_old(data, error=True)
    known = type(event).SCHEMA_VERSION
    if event.v > known:
        raise NewerSchemaError(f"{event.type} schema version {event.v} is newer than this service knows ({known})")
    if event.v < known:
        return _decode_old(data, error=False)
    return event


def _decode_old(data: bytes, *, error: bool) -> Event:
    """Decode through the upcast chain: the document from its version up to the current one."""
    doc = msgspec.json.decode(data)
    kind = _EVENT_TYPES.get(str(doc.get("type"))) if isinstance(doc, dict) else None
    if kind is None:
        return _event_decoder.decode(data)  # raises the decoder's own error
    version = int(doc.get("v", 1))
    known = int(kind.SCHEMA_VERSION)
    if version > known:
        raise NewerSchemaError(f"{doc['type']} schema version {version} is newer than this service knows ({known})")
    stepped = False
    while version < known:
        step = UPCASTS.get((doc["type"], version))
        if step is not None:
            doc = step(dict(doc))
            stepped = True
        version += 1
        doc["v"] = version
    if error and not stepped:
        return _event_decoder.decode(data)  # not an older shape: the original validation error
    return _event_decoder.decode(msgspec.json.encode(doc))  # JSON's own rules (datetimes as text)


def decoder_for(kind: type[T]) -> msgspec.json.Decoder[T]:
    """A cached decoder for one type (or a union)."""
    dec = _decoders.get(kind)
    if dec is None:
        dec = msgspec.json.Decoder(kind)
        _decoders[kind] = dec
    return dec


def decode(data: bytes | str, kind: type[T]) -> T:
    """Decode `data` as `kind`."""
    return decoder_for(kind).decode(data)


def convert(obj: Any, kind: type[T]) -> T:
    """Validate already-parsed data (YAML, dicts) as `kind`."""
    return msgspec.convert(obj, kind)


def to_builtins(value: Any) -> Any:
    """A contract value as plain JSON-compatible Python."""
    return msgspec.to_builtins(value)
