"""The hash chain that seals a run's trajectory (pure; `evalbus verify` recomputes it).

Exact definition, so anyone can recompute a seal from the `events` table:

1. Take the run's rows of `events` (`run_id = <run>`) ordered by `stream_seq` ascending.
2. For each row, the *canonical bytes* of its body are::

       json.dumps(json.loads(body_text), sort_keys=True, separators=(",", ":"),
                  ensure_ascii=False).encode("utf-8")

   where `body_text` is the `body` column as PostgreSQL prints it (`body::text`). That is: keys
   sorted by Unicode code point at every level, no whitespace, non-ASCII characters as UTF-8 (not
   `\\u` escapes), strings escaped as Python's `json` module does, integers exact, and other
   numbers as the shortest text that round-trips their IEEE-754 double (so `1e-07` and
   `0.0000001` hash the same; the producers write doubles).
3. With lower-case hexadecimal SHA-256 digests as ASCII text::

       h_0 = "0" * 64
       h_i = sha256_hex( h_{i-1} || sha256_hex(canonical_bytes_i) )

   where `||` concatenates the two 64-character hex strings (128 ASCII bytes are hashed).
4. The seal stores the head `h_n`, `n`, the first and last sequence, and every `(seq_i, h_i)`, so
   a verifier can name the first event whose link no longer matches.

In shell terms, one link is `printf '%s%s' "$prev" "$(printf '%s' "$canon" | sha256sum | cut -c1-64)"
| sha256sum`.

`sha256_hex(canonical_bytes_i)` is the event's *body digest*. The recorder computes it when it
inserts the event (`stored_body_digest`, from the payload it sends, without reading the row back)
and keeps it in `events.body_sha256`, so sealing a run chains stored digests instead of re-reading
and re-encoding its bodies. `evalbus verify` never trusts that column: it recomputes every digest
from `body::text` with `body_digest`, the reference.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterable
from decimal import Decimal

import msgspec

GENESIS = "0" * 64
"""h_0: the hash before the first event."""


def canonical_bytes(body_text: str) -> bytes:
    """The canonical bytes of one stored event body (see the module docstring)."""
    value = json.loads(body_text)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def body_digest(body_text: str) -> str:
    """sha256_hex of the canonical bytes of a stored body (`body::text`): the reference digest."""
    return hashlib.sha256(canonical_bytes(body_text)).hexdigest()


def link_digest(previous: str, digest: str) -> str:
    """h_i from h_{i-1} and the body digest of event i."""
    return hashlib.sha256((previous + digest).encode("ascii")).hexdigest()


def chain_digests(digests: Iterable[str]) -> list[str]:
    """Every h_i (i = 1..n) for body digests in sequence order; the last one is the head."""
    hashes: list[str] = []
    current = GENESIS
    for digest in digests:
        current = link_digest(current, digest)
        hashes.append(current)
    return hashes


def chain(bodies: Iterable[str]) -> list[str]:
    """Every h_i (i = 1..n) for stored bodies in sequence order; the last one is the head."""
    return chain_digests(body_digest(body) for body in bodies)


# ---------------------------------------------------------------- the digest of a body before it is stored


class _Unsure(Exception):
    """A number whose stored form this module does not vouch for."""


_MAX_PLAIN_TOKEN = 300
"""Longest number without an exponent handled here (its double is finite)."""
_MAX_EXPONENT_TOKEN = 64
"""Longest number with an exponent handled here."""
_MAX_EXPONENT = 300
"""Largest positive exponent handled here (numeric prints every digit)."""


@functools.lru_cache(maxsize=4096)  # numbers repeat from event to event: scores, costs, timings
def _stored_number(token: str) -> int | msgspec.Raw:
    """A JSON number with a fraction or an exponent, as `canonical_bytes` writes it after PostgreSQL
    stored it in a jsonb column.

    jsonb keeps a number as `numeric`, which prints in plain notation with the number's scale:
    digits after the point minus the exponent, at least 0 (`1.50` stays `1.50`, `1e-7` becomes
    `0.0000001`, `1.5E+3` becomes `1500`, `-0.0` becomes `0.0`). Read back by `json.loads`, a
    printed number without a point is an integer and any other is the double nearest its exact
    value, which is the double nearest the token's own value (they are the same number).
    """
    if "e" in token or "E" in token:
        return _stored_exponent_number(token)
    if len(token) > _MAX_PLAIN_TOKEN:
        raise _Unsure
    value = float(token)
    if value == 0.0 and not token.strip("-0."):
        value = 0.0  # numeric has no negative zero (a tiny non-zero value keeps its sign)
    return msgspec.Raw(repr(value))


def _stored_exponent_number(token: str) -> int | msgspec.Raw:
    """`_stored_number` of a number written with an exponent."""
    if len(token) > _MAX_EXPONENT_TOKEN:
        raise _Unsure
    exponent = Decimal(token).as_tuple().exponent
    if not isinstance(exponent, int):  # pragma: no cover - NaN/Infinity are not JSON numbers
        raise _Unsure
    if exponent >= 0:  # no digit left after the point: printed (and read back) as an integer
        if exponent > _MAX_EXPONENT:
            raise _Unsure
        return int(Decimal(token))
    value = float(token)
    if not math.isfinite(value):
        raise _Unsure
    if value == 0.0 and not token[: max(token.find("e"), token.find("E"))].strip("-0."):
        value = 0.0
    return msgspec.Raw(repr(value))


_stored_decoder = msgspec.json.Decoder(float_hook=_stored_number)
_sorted_encoder = msgspec.json.Encoder(order="sorted")


def stored_body_digest(body_text: str) -> str | None:
    """The `body_digest` PostgreSQL's stored text of this payload will have, computed from the
    payload itself; None when this function cannot vouch for it (the caller then reads `body::text`
    back after the insert).

    Storing JSON as jsonb keeps strings, booleans, nulls and object keys (the last of duplicate
    keys wins, as in `json.loads`) and changes numbers only (`_stored_number`); whitespace and key
    order do not reach the canonical bytes. msgspec's sorted encoder writes keys, strings and
    integers byte for byte as `canonical_bytes` does (keys by code point, the same escapes; integer
    tokens are decoded exactly, `-0` as 0 as numeric prints it), and every other number is
    written here as `repr` of its double, as `json.dumps` does. It is several times faster than
    `body_digest`; tests hold the two equal against PostgreSQL.
    """
    try:
        value = _stored_decoder.decode(body_text)
        return hashlib.sha256(_sorted_encoder.encode(value)).hexdigest()
    except (_Unsure, msgspec.DecodeError, ValueError, RecursionError, OverflowError):
        return None
