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
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

GENESIS = "0" * 64
"""h_0: the hash before the first event."""


def canonical_bytes(body_text: str) -> bytes:
    """The canonical bytes of one stored event body (see the module docstring)."""
    value = json.loads(body_text)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def link(previous: str, body_text: str) -> str:
    """h_i from h_{i-1} and the stored body of event i."""
    digest = hashlib.sha256(canonical_bytes(body_text)).hexdigest()
    return hashlib.sha256((previous + digest).encode("ascii")).hexdigest()


def chain(bodies: Iterable[str]) -> list[str]:
    """Every h_i (i = 1..n) for bodies in sequence order; the last one is the head."""
    hashes: list[str] = []
    current = GENESIS
    for body in bodies:
        current = link(current, body)
        hashes.append(current)
    return hashes
