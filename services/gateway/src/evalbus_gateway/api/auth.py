"""Bearer-token auth with two roles.

- The admin token (`GATEWAY_ADMIN_TOKEN`) is the principal `admin` with role `admin`.
- The tokens file (`GATEWAY_TOKENS_FILE`) maps more tokens to principals:
  `{"<token>": {"principal": "alice", "role": "member"}, ...}`.

An admin sees and cancels every batch; a member only the batches it submitted (the submitter is
the batch's creator).

The web dashboard logs in by exchanging a token for an HttpOnly, SameSite=Strict session cookie
(`SESSION_COOKIE`, `POST /ui/login`), so a token never goes into a URL and page scripts never see
it; the cookie authenticates the API like the header does. The cookie is a signed session that
ends after 12 hours (checked by the gateway, not only the browser) and never holds the token
(`TokenTable.session_for`); logging out clears it in the browser, and dropping a token from the
tokens file ends its sessions. A write authenticated by the cookie must
also carry `X-Evalbus-Csrf: 1` — a header another site's page cannot add without a CORS preflight
the gateway never grants — so a cross-site form cannot act with a reader's session. Tokens are kept as SHA-256 digests and compared by digest, so a lookup
takes the same time whichever token is presented, and the table never holds a plain token.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from aiohttp import web

from evalbus_api.models import Role
from evalbus_api.numbers import whole_number
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


SESSION_VERSION = "v1"
"""The format of a dashboard session (`TokenTable.session_for`)."""


def _token_id(token: str) -> str:
    """A name for a token that gives nothing of it away (a digest, apart from `_digest`'s)."""
    return hashlib.sha256(b"evalbus session\0" + token.encode("utf-8", "surrogateescape")).hexdigest()[:24]


def _session_mac(key: bytes, claims: str) -> bytes:
    return hmac.new(key, claims.encode("utf-8"), hashlib.sha256).hexdigest().encode()


def _digest(token: str) -> bytes:
    # A header that was not UTF-8 reaches us with its bytes as surrogate escapes: digest those
    # bytes (no token matches them) rather than fail on them.
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class TokenTable:
    """Token digests → principals."""

    def __init__(self, principals: dict[str, Principal] | None = None) -> None:
        self._by_digest = {_digest(token): p for token, p in (principals or {}).items()}
        self._by_id = {_token_id(token): (_digest(token), p) for token, p in (principals or {}).items()}

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, token: str) -> Principal | None:
        """The principal of `token`, if any."""
        return self._by_digest.get(_digest(token))

    def session_for(self, token: str, now: float, max_age_s: float) -> str | None:
        """A dashboard session for `token` (None when no principal has it): `v1.<token id>.<expiry>.
        <mac>`, the token id a digest of the token, the mac an HMAC keyed by the token's digest. The
        cookie never holds the token, every replica verifies it alike, it ends at its expiry
        whatever the browser does, and it dies with its token when the tokens file drops it."""
        if self.lookup(token) is None:
            return None
        claims = f"{SESSION_VERSION}.{_token_id(token)}.{int(now + max_age_s)}"
        return f"{claims}.{_session_mac(_digest(token), claims).decode()}"

    def session_principal(self, session: str, now: float) -> Principal | None:
        """The principal of a session `session_for` made, unless it expired or is not one."""
        version, _, rest = session.partition(".")
        token_id, _, rest = rest.partition(".")
        expiry, _, mac = rest.partition(".")
        found = self._by_id.get(token_id)
        expires = whole_number(expiry, max_digits=12)
        if version != SESSION_VERSION or found is None or expires is None or expires <= now:
            return None
        digest, principal = found
        expected = _session_mac(digest, f"{version}.{token_id}.{expiry}")
        return principal if hmac.compare_digest(expected, mac.encode("utf-8", "surrogateescape")) else None

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
"""The dashboard's session cookie (HttpOnly): a signed, expiring session, never the token
(`TokenTable.session_for`)."""
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
            principal = tokens.session_principal(session, time.time())
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
