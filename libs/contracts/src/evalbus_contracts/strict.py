"""Strict reading of specs a person wrote: unknown keys and values outside a fixed set.

Contracts decode leniently on purpose — an event written by a newer release may carry fields an
older reader does not know, and it must still read it (schema evolution). Input a person typed is
the opposite case: `trails: 3` for `trials` would otherwise run as if the key were absent. So the
edges that take user input (the CLI's suite loading, the gateway's request bodies) walk the raw
document against the spec's type before converting it, and refuse what the type does not know,
naming the field path and the nearest known key. Event decoders never call this.

The walk follows the document where it has the expected shape and leaves everything else (a wrong
type, a missing field) to msgspec's own validation, which runs afterwards.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterable
from typing import Any

import msgspec
import msgspec.inspect as mi

_SEQUENCE_TYPES = (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)
_MAX_LISTED = 12


class StrictProblem(msgspec.Struct, frozen=True):
    """A key or value the spec's type does not know."""

    field: str
    """JSON path of the unknown key (`$.policy.trails`) or of the value outside its set."""
    message: str
    """What is wrong, with the nearest known key or the allowed values."""


def strict_problems(data: Any, kind: Any, root: str = "$") -> list[StrictProblem]:
    """Every unknown key and every value outside a fixed set (a `Literal`, a union's `kind` tag) in
    `data`, plain parsed JSON/YAML meant to be converted to `kind`; in document order, empty when
    there is none. Paths start at `root`."""
    out: list[StrictProblem] = []
    _walk(data, _type_info(kind), root, out)
    return out


def join_path(path: str, key: str) -> str:
    """`path` extended by a mapping key: `$.a.b` for an identifier, `$.a["b c"]` otherwise."""
    return f"{path}.{key}" if key.isidentifier() else f"{path}[{msgspec.json.encode(key).decode()}]"


def nearest(word: str, known: Iterable[str]) -> str | None:
    """The known word closest to `word` (a typo's likely intent), or None when none is close."""
    choices = list(known)
    lowered = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match else None


@functools.cache
def _type_info(kind: Any) -> mi.Type:
    return mi.type_info(kind)


def _walk(data: Any, t: mi.Type, path: str, out: list[StrictProblem]) -> None:
    if isinstance(t, mi.Metadata):
        _walk(data, t.type, path, out)
    elif isinstance(t, mi.StructType):
        _struct(data, t, path, out, tag_checked=False)
    elif isinstance(t, mi.UnionType):
        _union(data, t, path, out)
    elif isinstance(t, _SEQUENCE_TYPES):
        if isinstance(data, list):
            for i, item in enumerate(data):
                _walk(item, t.item_type, f"{path}[{i}]", out)
    elif isinstance(t, mi.TupleType):
        if isinstance(data, list):
            for i, (item, item_type) in enumerate(zip(data, t.item_types, strict=False)):
                _walk(item, item_type, f"{path}[{i}]", out)
    elif isinstance(t, mi.DictType):
        if isinstance(data, dict):
            for key, value in data.items():
                _walk(value, t.value_type, join_path(path, str(key)), out)
    elif isinstance(t, mi.LiteralType):
        _value(data, t.values, path, out)


def _struct(data: Any, t: mi.StructType, path: str, out: list[StrictProblem], *, tag_checked: bool) -> None:
    if not isinstance(data, dict):
        return
    fields = {f.encode_name: f for f in t.fields}
    for key, value in data.items():
        if not isinstance(key, str):
            continue  # msgspec names it: object keys must be strings
        if key == t.tag_field:
            if not tag_checked and t.tag is not None:
                _value(value, (t.tag,), join_path(path, key), out)
            continue
        field = fields.get(key)
        if field is None:
            known = [*fields, *([t.tag_field] if t.tag_field else [])]
            out.append(StrictProblem(join_path(path, key), _unknown_key(key, known)))
        else:
            _walk(value, field.type, join_path(path, key), out)


def _union(data: Any, t: mi.UnionType, path: str, out: list[StrictProblem]) -> None:
    members = t.types
    if isinstance(data, dict):
        structs = [m for m in members if isinstance(m, mi.StructType)]
        tagged = [s for s in structs if s.tag_field is not None]
        if tagged:
            tag_field = str(tagged[0].tag_field)
            if tag_field not in data:
                return  # msgspec names the missing tag
            value = data[tag_field]
            chosen = next((s for s in tagged if s.tag == value), None)
            if chosen is None:
                _value(value, tuple(s.tag for s in tagged if s.tag is not None), join_path(path, tag_field), out)
            else:
                _struct(data, chosen, path, out, tag_checked=True)
            return
        if structs:
            _struct(data, structs[0], path, out, tag_checked=False)
            return
        dicts = [m for m in members if isinstance(m, mi.DictType)]
        if dicts:
            _walk(data, dicts[0], path, out)
    elif isinstance(data, list):
        sequences = [m for m in members if isinstance(m, (*_SEQUENCE_TYPES, mi.TupleType))]
        if sequences:
            _walk(data, sequences[0], path, out)
    else:
        literals = [m for m in members if isinstance(m, mi.LiteralType)]
        plain = (mi.StrType, mi.IntType, mi.FloatType, mi.BoolType)
        if literals and not any(isinstance(m, plain) for m in members):
            _value(data, tuple(v for lit in literals for v in lit.values), path, out)


def _value(data: Any, allowed: tuple[Any, ...], path: str, out: list[StrictProblem]) -> None:
    if isinstance(data, bool) or not isinstance(data, (str, int)) or data in allowed:
        return  # a wrong type is msgspec's to name
    texts = [str(v) for v in allowed]
    hint = nearest(data, texts) if isinstance(data, str) else None
    listed = ", ".join(texts[:_MAX_LISTED]) + (", …" if len(texts) > _MAX_LISTED else "")
    message = f"Invalid value {data!r}; " + (f"did you mean {hint!r}? " if hint else "") + f"expected one of: {listed}"
    out.append(StrictProblem(path, message))


def _unknown_key(key: str, known: list[str]) -> str:
    hint = nearest(key, known)
    if hint is not None:
        return f"unknown field; did you mean `{hint}`?"
    listed = ", ".join(f"`{k}`" for k in sorted(known))
    return f"unknown field (known: {listed})" if known else "unknown field (no fields are known here)"


_AT = re.compile(r"^(?P<message>.*?) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_NAMED = re.compile(r"^Object (?:missing required|contains unknown) field `(?P<name>[^`]+)`")


def error_location(error: msgspec.ValidationError, root: str = "$") -> tuple[str, str]:
    """`(field, message)` of a msgspec validation error: the JSON path of the bad value under
    `root`, extended by the field's name when a required one is missing or an unknown one present."""
    text = str(error)
    match = _AT.match(text)
    message, path = (match["message"], root + match["path"]) if match else (text, root)
    named = _NAMED.match(message)
    if named is not None:
        path = join_path(path, named["name"])
    return path, message
