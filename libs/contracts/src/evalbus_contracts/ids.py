"""Identifiers: the reversible subject-token encoding and the derivable run id.

NATS subject tokens may not contain `.`, `*`, `>` or whitespace. evalbus keeps ids that are
already plain (`[A-Za-z0-9_-]`) readable as they are and escapes every other byte of the UTF-8
form as `~XX` (upper-case hex). `~` is outside the plain set, so the encoding is reversible and
an encoded token can never collide with a plain one.
"""

from __future__ import annotations

import re

_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_ESCAPE = re.compile(r"~([0-9A-F]{2})")
_PLAIN_ID = re.compile(r"[A-Za-z0-9_-]+")


class InvalidIdError(ValueError):
    """An id that cannot be used: empty, or a token that is not a valid encoding."""


def encode_token(raw_id: str) -> str:
    """Encode an id as one subject-safe token; the payload always keeps the real id."""
    if not raw_id:
        raise InvalidIdError("an id must not be empty")
    if _PLAIN_ID.fullmatch(raw_id):
        return raw_id  # the common case, without the per-byte loop
    out: list[str] = []
    for byte in raw_id.encode("utf-8"):
        out.append(chr(byte) if byte in _PLAIN else f"~{byte:02X}")
    return "".join(out)


def decode_token(token: str) -> str:
    """Invert `encode_token`. Raises `InvalidIdError` for anything it could not have produced."""
    if not token:
        raise InvalidIdError("a token must not be empty")
    buf = bytearray()
    i = 0
    while i < len(token):
        ch = token[i]
        if ch == "~":
            m = _ESCAPE.match(token, i)
            if m is None:
                raise InvalidIdError(f"bad escape in token {token!r} at {i}")
            value = int(m.group(1), 16)
            if value in _PLAIN:
                raise InvalidIdError(f"needless escape in token {token!r} at {i}")
            buf.append(value)
            i += 3
            continue
        if ord(ch) > 127 or ord(ch) not in _PLAIN:
            raise InvalidIdError(f"character {ch!r} cannot appear in a token")
        buf.append(ord(ch))
        i += 1
    try:
        return buf.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidIdError(f"token {token!r} is not UTF-8") from e


def batch_run_id(batch_id: str, case_id: str, trial: int | None = None) -> str:
    """The run id of a batch case: `evb-<batch>-<case>[-t<trial>]` (trial only when trials > 1)."""
    if not batch_id or not case_id:
        raise InvalidIdError("batch and case ids must not be empty")
    base = f"evb-{batch_id}-{case_id}"
    return base if trial is None else f"{base}-t{trial}"


def standalone_run_id(run: str) -> str:
    """The run id of a standalone run: `evb-run-<id>`."""
    if not run:
        raise InvalidIdError("run id must not be empty")
    return f"evb-run-{run}"
