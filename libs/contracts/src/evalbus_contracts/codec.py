"""JSON encoders and decoders, built once per process (msgspec's fast path)."""

from __future__ import annotations

from typing import Any, TypeVar

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
    reason) rather than guess; older versions are read as they are (fields are only ever added
    with defaults)."""


def decode_event(data: bytes) -> Event:
    """Decode any event by its `type` tag; unknown fields are ignored, a schema version newer than
    the event type's `SCHEMA_VERSION` is refused (`NewerSchemaError`)."""
    event = _event_decoder.decode(data)
    known = type(event).SCHEMA_VERSION
    if event.v > known:
        raise NewerSchemaError(f"{event.type} schema version {event.v} is newer than this service knows ({known})")
    return event


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
