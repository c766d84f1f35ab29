"""Bearer-token auth with two roles.

- The admin token (`GATEWAY_ADMIN_TOKEN`) is the principal `admin` with role `admin`.
- The tokens file (`GATEWAY_TOKENS_FILE`) maps more tokens to principals:
  `{"<token>": {"principal": "alice", "role": "member"}, ...}`.

An admin sees and cancels every batch; a member only the batches it submitted (the submitter is
the batch's creator).

The web dashboard logs in by exchanging a token for an HttpOnly, SameSite=Strict session cookie
(`SESSION_COOKIE`, `POST /ui/login`), so a token never goes into a URL and page scripts never see
it; the cookie authenticates the API like the header does. A write authenticated by the cookie must
also carry `X-Evalbus-Csrf: 1` — a header another site's page cannot add without a CORS preflight
the gateway never grants — so a cross-site form cannot act with a reader's session. Tokens are kept as SHA-256 digests and compared by digest, so a lookup
takes the same time whichever token is presented, and the table never holds a plain token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import msgspec
from aiohttp import web

from evalbus_api.models import Role
from evalbus_gateway.api.errors import ApiError
from evalbus_gateway.errors import TokensFileError

ADMIN_PRINCIPAL = "admin"
"""Principal name of the admin token."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from."""

    name: str
    """Principal name; recorded as `submitted_by` on the batches it submits."""
    role: Role
    """`admin` or `member`."""

    @property
    def is_admin(self) -> bool:
        """Whether it may see and act on every batch."""
        return self.role == "admin"

    def may_access(self, owner: str | None) -> bool:
        """Whether it may see and cancel a batch submitted by `owner`."""
        return self.is_admin or (owner is not None and owner == self.name)


class TokenEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One entry of the tokens file."""

    principal: str
    """Principal name."""
    role: Role = "member"
    """`admin` or `member`."""


def _digest(token: str) -> bytes:
    # A header that was not UTF-8 reaches us with its bytes as surrogate escapes: digest those
    # bytes (no token matches them) rather than fail on them.
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class TokenTable:
    """Token digests → principals."""

    def __init__(self, principals: dict[str, Principal] | None = None) -> None:
        self._by_digest = {_digest(token): p for token, p in (principals or {}).items()}

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, token: str) -> Principal | None:
        """The principal of `token`, if any."""
        return self._by_digest.get(_digest(token))

    @classmethod
    def from_settings(cls, admin_token: str | None, tokens_file: str | None) -> TokenTable:
        """The admin token plus the tokens file (read once, at start)."""
        principals = load_tokens_file(Path(tokens_file)) if tokens_file else {}
        if admin_token:
            principals[admin_token] = Principal(name=ADMIN_PRINCIPAL, role="admin")
        return cls(principals)


def load_tokens_file(path: Path) -> dict[str, Principal]:
    """Read a tokens file; raises `TokensFileError` naming what is wrong (never the token)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TokensFileError(f"cannot read tokens file {path}: {e.strerror or e}") from e
    try:
        entries = msgspec.json.decode(data, type=dict[str, TokenEntry])
    except msgspec.ValidationError as e:
        # The path names the token; report only the field inside an entry.
        detail = str(e).split(" - at ", 1)[0]
        raise TokensFileError(f"tokens file {path}: {detail}") from None
    except msgspec.DecodeError as e:
        raise TokensFileError(f"tokens file {path} is not JSON: {e}") from e
    out: dict[str, Principal] = {}
    for index, (token, entry) in enumerate(entries.items()):
        if not token.strip():
            raise TokensFileError(f"tokens file {path}: entry {index} has an empty token")
        if not entry.principal.strip():
            raise TokensFileError(f"tokens file {path}: entry {index} has an empty principal")
        out[token] = Principal(name=entry.principal, role=entry.role)
    return out


_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="evalbus"'}

SESSION_COOKIE = "evalbus_session"
"""The dashboard's session cookie (it holds the token, HttpOnly)."""
CSRF_HEADER = "X-Evalbus-Csrf"
"""Required on writes authenticated by the session cookie."""
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def authenticate(request: web.Request, tokens: TokenTable) -> Principal:
    """The principal of the request's bearer token (or dashboard session cookie); 401 naming the
    `Authorization` header otherwise."""
    header = request.headers.get("Authorization")
    if header is None:
        session = request.cookies.get(SESSION_COOKIE)
        if session:
            principal = tokens.lookup(session)
            if principal is None:
                raise ApiError(401, "unauthorized", "the session has ended: log in again", "Authorization")
            if request.method not in _SAFE_METHODS and request.headers.get(CSRF_HEADER) != "1":
                raise ApiError(403, "forbidden", f"a write with the session cookie needs {CSRF_HEADER}: 1", CSRF_HEADER)
            return principal
        raise ApiError(401, "unauthorized", "missing bearer token", "Authorization", headers=_CHALLENGE)
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise ApiError(
            401, "unauthorized", "expected 'Authorization: Bearer <token>'", "Authorization", headers=_CHALLENGE
        )
    principal = tokens.lookup(token)
    if principal is None:
        raise ApiError(401, "unauthorized", "unknown token", "Authorization", headers=_CHALLENGE)
    return principal


def require_admin(principal: Principal) -> None:
    """403 unless `principal` is an admin."""
    if not principal.is_admin:
        raise ApiError(403, "forbidden", f"{principal.name!r} is a member; this needs the admin role", "Authorization")
