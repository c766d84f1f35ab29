"""NATS nkeys and JWTs, as nats-server's auth callout speaks them (Ed25519 on `cryptography`).

- `AccountKey`: an account nkey pair (`A…` public, `SA…` seed), the callout's issuer.
- `public_key`: the Ed25519 key of a public nkey (`A` account, `N` server, `U` user).
- `encode_jwt` / `decode_jwt`: `ed25519-nkey` JWTs of claim version 2 (the standard claims in the
  order NATS lists them, `jti` the SHA-512/256 of them, signed over `header.payload`).

Written here rather than taken from the `nkeys` package: what evalbus needs is these hundred lines.
Tested against nats-server itself (tests/test_runner_auth.py).
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# ---------------------------------------------------------------- nkeys

_KIND = {"A": 0 << 3, "N": 13 << 3, "U": 20 << 3}
"""The first byte of an account, server and user public nkey."""
_SEED = 18 << 3


def _crc16(data: bytes) -> int:
    """CRC-16/XMODEM (polynomial 0x1021, initial 0), the nkey checksum."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def _armoured(body: bytes) -> str:
    return base64.b32encode(body + _crc16(body).to_bytes(2, "little")).decode().rstrip("=")


def _unarmoured(text: str, *, secret: bool = False) -> bytes:
    shown = "a seed" if secret else f"{text[:12]}…"  # never a piece of a seed in an error
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except ValueError as e:
        raise ValueError(f"not an nkey: {shown}") from e
    if len(raw) < 3 or _crc16(raw[:-2]).to_bytes(2, "little") != raw[-2:]:
        raise ValueError(f"not an nkey (checksum): {shown}")
    return raw[:-2]


def public_key(text: str, kind: str) -> Ed25519PublicKey:
    """The Ed25519 key of a public nkey of `kind` (`A` account, `N` server, `U` user)."""
    body = _unarmoured(text)
    if len(body) != 33 or body[0] != _KIND[kind]:
        raise ValueError(f"not a public nkey of kind {kind}: {text[:12]}…")
    return Ed25519PublicKey.from_public_bytes(body[1:])


@dataclass(frozen=True)
class AccountKey:
    """An account nkey pair: the auth callout's issuer. `public` goes in the server's config
    (`issuer`), `seed` only to the dispatchers."""

    private: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> AccountKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: str) -> AccountKey:
        """From an account seed (`SA…`); a ValueError names what is wrong, never the seed."""
        body = _unarmoured(seed.strip(), secret=True)
        if len(body) != 34 or body[0] & 0xF8 != _SEED or ((body[0] & 0x07) << 5 | body[1] >> 3) != _KIND["A"]:
            raise ValueError("not an account seed (SA…)")
        return cls(Ed25519PrivateKey.from_private_bytes(body[2:]))

    @property
    def public(self) -> str:
        return _armoured(bytes([_KIND["A"]]) + self.private.public_key().public_bytes_raw())

    @property
    def seed(self) -> str:
        kind = _KIND["A"]
        return _armoured(bytes([_SEED | kind >> 5, (kind & 31) << 3]) + self.private.private_bytes_raw())

    def token_key(self) -> bytes:
        """The run tokens' HMAC key, derived from the seed."""
        return hashlib.sha256(b"evalbus run token\0" + self.private.private_bytes_raw()).digest()


# ---------------------------------------------------------------- JWTs

_STANDARD = ("aud", "exp", "jti", "iat", "iss", "name", "nbf", "sub")
"""The standard claims, in the order NATS JWTs list them."""


def b64url(data: bytes) -> str:
    """Base64url without padding (JWT parts, run tokens)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    """The bytes of `b64url` text (ValueError when it is none)."""
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


_HEADER = b64url(_json({"typ": "JWT", "alg": "ed25519-nkey"}))


def encode_jwt(key: AccountKey, claims: dict[str, Any], nats: dict[str, Any], *, now: float | None = None) -> str:
    """A NATS JWT of claim version 2 with the standard `claims` (`sub`, `aud`, `exp`, `name`) and
    the `nats` part, issued and signed by `key`."""
    standard = {**claims, "iss": key.public, "iat": int(time.time() if now is None else now)}
    standard = {k: standard[k] for k in _STANDARD if standard.get(k) and k != "jti"}
    jti = base64.b32encode(hashlib.new("sha512_256", _json(standard)).digest()).decode().rstrip("=")
    body = {**standard, "jti": jti, "nats": {**nats, "version": 2}}
    ordered = {k: body[k] for k in (*_STANDARD, "nats") if k in body}
    signing_input = f"{_HEADER}.{b64url(_json(ordered))}"
    return f"{signing_input}.{b64url(key.private.sign(signing_input.encode()))}"


def decode_jwt(token: str, issuer_kind: str) -> dict[str, Any]:
    """The claims of a NATS JWT whose signature verifies against its `iss`, a public nkey of
    `issuer_kind`; ValueError otherwise."""
    try:
        header, payload, signature = token.split(".")
        if json.loads(unb64url(header)).get("alg", "").lower() not in ("ed25519-nkey", "ed25519"):
            raise ValueError("not an ed25519-nkey JWT")
        claims = json.loads(unb64url(payload))
        if not isinstance(claims, dict):
            raise ValueError("its claims are no object")  # noqa: TRY004 - every failure here is a ValueError
        public_key(str(claims.get("iss", "")), issuer_kind).verify(unb64url(signature), f"{header}.{payload}".encode())
    except InvalidSignature as e:
        raise ValueError("its signature does not verify") from e
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"not a JWT: {type(e).__name__}") from e
    return claims
