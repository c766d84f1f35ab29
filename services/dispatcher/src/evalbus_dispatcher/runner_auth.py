"""Per-run NATS credentials for the in-job runners, through nats-server's auth callout (config mode).

Why: with one shared `runner` password, a harness that reads its runner's environment from /proc
could publish the live log and trace of any run. With a run token, what it can read is worth what
it already has: the token names one run and an expiry, and the user the callout makes of it may
publish only that run's live log and trace (`live_subject`) and subscribe to nothing, until then.

How:
- `RunTokens` mints and checks the tokens: `evbrun1.<run id, base64url>.<exp>.<HMAC-SHA256>`, the
  HMAC key derived from the issuer's seed, so every dispatcher replica holding the seed checks the
  tokens of every other one and no state is shared.
- `RunnerAuth` answers nats-server's authorization requests (`$SYS.REQ.USER.AUTH`, a queue group,
  so replicas share them): a valid token gets a user JWT for the evalbus account with those
  permissions and `exp`; anything else gets an error, and the connection is refused. A static
  user that logs in with its password never reaches it (`allowed_accounts` in the server's
  `auth_callout` block, docs/deploy.md).
- The nkeys and JWTs the callout speaks are `evalbus_runtime.nkeys`.

The server's side is tested live (tests/test_runner_auth.py, the nats-server wheel). Nothing here
logs a token or a request's connect options: those of a client that reached the callout by mistake
hold its password in clear.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import CollectorRegistry, Counter

from evalbus_contracts.subjects import live_subject
from evalbus_runtime.nkeys import AccountKey, b64url, decode_jwt, encode_jwt, public_key, unb64url

log = logging.getLogger(__name__)

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
"""Where nats-server sends its authorization requests (in the `auth_callout` block's account)."""
AUTH_QUEUE = "evalbus-runner-auth"
"""The responders' queue group: one dispatcher replica answers each request."""
ACCOUNT = "EVALBUS"
"""The account the runners' users are placed in (`evalbus.infra.nats_accounts.ACCOUNT`)."""
TOKEN_PREFIX = "evbrun1"  # noqa: S105 - the tokens' version tag, no secret
"""The first part of every run token (its format's version)."""
TOKEN_MARGIN_S = 600.0
"""Added to a job's longest life when its token's expiry is chosen: the NATS servers enforce it on
their clocks, which may be minutes off the minting dispatcher's (a longer life costs nothing: the
token is worth its run's live view only)."""

# ---------------------------------------------------------------- run tokens


class RunTokenError(ValueError):
    """A token the callout refuses (the reason is sent to the server's log, never the token)."""


@dataclass(frozen=True)
class RunTokens:
    """Mints and checks run tokens with one HMAC key (`AccountKey.token_key`)."""

    key: bytes

    def mint(self, run_id: str, ttl_s: float, *, now: float | None = None) -> str:
        """A token for `run_id`, valid `ttl_s` seconds from `now`."""
        exp = int((time.time() if now is None else now) + ttl_s) + 1
        body = f"{TOKEN_PREFIX}.{b64url(run_id.encode())}.{exp}"
        return f"{body}.{b64url(self._mac(body))}"

    def check(self, token: str, *, now: float | None = None) -> tuple[str, int]:
        """The run id and expiry (Unix seconds) of a valid token; RunTokenError otherwise."""
        parts = token.split(".")
        if len(parts) != 4 or parts[0] != TOKEN_PREFIX:
            raise RunTokenError("not a run token")
        body = ".".join(parts[:3])
        try:
            mac = unb64url(parts[3])
            run_id = unb64url(parts[1]).decode()
            exp = int(parts[2])
        except ValueError as e:
            raise RunTokenError("a malformed run token") from e
        if not hmac.compare_digest(mac, self._mac(body)):
            raise RunTokenError("a run token with a wrong signature")
        if exp <= (time.time() if now is None else now):
            raise RunTokenError(f"the run token of {run_id} has expired")
        if not run_id:
            raise RunTokenError("a run token without a run id")
        return run_id, exp

    def _mac(self, body: str) -> bytes:
        return hmac.new(self.key, body.encode(), hashlib.sha256).digest()


def runner_permissions(run_id: str) -> dict[str, Any]:
    """What a run's runner may do: publish its live log and trace, subscribe to nothing."""
    return {
        "pub": {"allow": [live_subject(run_id, "log"), live_subject(run_id, "trace")]},
        "sub": {"deny": [">"]},
    }


# ---------------------------------------------------------------- the responder


class RunnerAuth:
    """Answers nats-server's authorization requests for run tokens (see the module's docstring)."""

    def __init__(
        self, nc: NatsClient, issuer: AccountKey, *, account: str = ACCOUNT, registry: CollectorRegistry | None = None
    ) -> None:
        self._nc = nc
        self._issuer = issuer
        self._tokens = RunTokens(issuer.token_key())
        self._account = account
        self._sub: Subscription | None = None
        self.granted = 0
        self.refused = 0
        self._logins = Counter(
            "evalbus_runner_logins_total", "Runner logins answered (nats-server's auth callout)", ["outcome"],
            registry=registry if registry is not None else CollectorRegistry(),
        )  # fmt: skip

    @property
    def tokens(self) -> RunTokens:
        return self._tokens

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(AUTH_SUBJECT, queue=AUTH_QUEUE, cb=self._on_request)

    async def close(self) -> None:
        """Stop answering and close the connection (the other replicas answer from now on)."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        with contextlib.suppress(Exception):
            await self._nc.drain()

    def answer(self, request_jwt: str, *, now: float | None = None) -> str:
        """The signed authorization response to one request (a user JWT or an error)."""
        request = decode_jwt(request_jwt, "N")
        part = request.get("nats") or {}
        if part.get("type") != "authorization_request":
            raise ValueError(f"a JWT of type {str(part.get('type'))[:40]!r}, not an authorization request")
        if int(request.get("exp") or 0) and int(request["exp"]) < (time.time() if now is None else now):
            raise ValueError("an authorization request past its expiry (the server no longer waits for it)")
        user_nkey = str(part.get("user_nkey", ""))
        server_id = str((part.get("server_id") or {}).get("id", ""))
        options = part.get("connect_opts") or {}
        token = str(options.get("auth_token") or options.get("pass") or "")
        reply: dict[str, Any] = {"type": "authorization_response"}
        try:
            run_id, exp = self._tokens.check(token, now=now)
            public_key(user_nkey, "U")
        except (RunTokenError, ValueError) as e:
            self.refused += 1
            self._logins.labels("refused").inc()
            reply["error"] = str(e) if isinstance(e, RunTokenError) else "the request names no user key"
            log.info("a login refused: %s", reply["error"])  # the reason only: never what the client sent
        else:
            self.granted += 1
            self._logins.labels("granted").inc()
            user = {"sub": user_nkey, "aud": self._account, "name": f"runner-{run_id}", "exp": exp}
            reply["jwt"] = encode_jwt(self._issuer, user, {**runner_permissions(run_id), "type": "user"}, now=now)
        return encode_jwt(self._issuer, {"sub": user_nkey, "aud": server_id}, reply, now=now)

    async def _on_request(self, msg: Msg) -> None:
        try:
            response = self.answer(msg.data.decode("utf-8", "replace"))
        except ValueError as e:
            log.warning("an authorization request that is not one the server signed: %s", e)
            return
        await msg.respond(response.encode())
