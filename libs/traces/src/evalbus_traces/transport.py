"""HTTP requests to trace platforms, with failures translated into this package's errors.

A connection failure, a timeout or a 5xx is `TraceUnavailableError`; callers read 2xx and 404
themselves and pass other 4xx to `reject`. Header values (credentials) never appear in errors —
not even when a platform quotes the credential it was sent in its error body, as some do
("invalid token sk-…"): the quoted body is masked before it goes into a message.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import aiohttp

from evalbus_traces.errors import TraceRejectedError, TraceUnavailableError

DEFAULT_TIMEOUT_S = 15.0
"""Per-request timeout."""
_BODY_CAP = 300
REDACTED = "[redacted]"
"""What a credential quoted by a platform is replaced with in an error message."""
_MIN_SECRET = 6
"""Shorter parts of a credential are not masked on their own (they would mask ordinary words)."""

Params = Mapping[str, str] | Sequence[tuple[str, str]]


class HttpResponse:
    """A platform's answer: status and body (read fully)."""

    __slots__ = ("_secrets", "body", "status", "url")

    def __init__(self, status: int, body: bytes, url: str, secrets: Iterable[str] = ()) -> None:
        self.status = status
        self.body = body
        self.url = url
        self._secrets = sorted({s for s in secrets if len(s) >= _MIN_SECRET}, key=len, reverse=True)

    @property
    def ok(self) -> bool:
        """2xx."""
        return 200 <= self.status < 300

    def json(self) -> Any:
        """The body as JSON (`{}` when empty); a non-JSON body is a rejected request."""
        if not self.body.strip():
            return {}
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise TraceRejectedError(f"{self.url}: answer is not JSON: {self.text()!r}") from e

    def text(self) -> str:
        """The start of the body, for error messages, with the request's credentials masked."""
        text = self.body.decode("utf-8", errors="replace")
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text[:_BODY_CAP]


def credential_forms(headers: Mapping[str, str]) -> set[str]:
    """Every form in which a platform might quote the credentials of `headers`: each value, the
    part after its scheme (`Bearer <token>`), and a Basic pair decoded with each of its halves."""
    out: set[str] = set()
    for value in headers.values():
        out.add(value)
        scheme, _, rest = value.partition(" ")
        if not rest:
            continue
        out.add(rest)
        if scheme.lower() == "basic":
            try:
                pair = base64.b64decode(rest, validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                continue
            out.update((pair, *pair.split(":", 1)))
    return out


async def send(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    params: Params | None = None,
    json_body: Any = None,
    data: bytes | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> HttpResponse:
    """Send one request; raise `TraceUnavailableError` when the platform is down or failing."""
    kwargs: dict[str, Any] = {"headers": dict(headers or {}), "timeout": aiohttp.ClientTimeout(total=timeout_s)}
    if params is not None:
        kwargs["params"] = list(params.items()) if isinstance(params, Mapping) else list(params)
    if json_body is not None:
        kwargs["json"] = json_body
    if data is not None:
        kwargs["data"] = data
    try:
        async with session.request(method, url, **kwargs) as resp:
            body = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise TraceUnavailableError(f"{method} {url}: {type(e).__name__}: {e}") from e
    result = HttpResponse(resp.status, body, url, credential_forms(kwargs["headers"]))
    if resp.status >= 500:
        raise TraceUnavailableError(f"{method} {url}: HTTP {resp.status}: {result.text()}")
    return result


def reject(resp: HttpResponse, what: str) -> TraceRejectedError:
    """The error for a refused request (4xx other than the 404 callers handle)."""
    return TraceRejectedError(f"{what}: HTTP {resp.status} from {resp.url}: {resp.text()}")


def expect_ok(resp: HttpResponse, what: str) -> Any:
    """The JSON body of a 2xx answer; anything else is rejected."""
    if not resp.ok:
        raise reject(resp, what)
    return resp.json()


def require_ok(resp: HttpResponse, what: str) -> None:
    """Reject anything but a 2xx, without reading the body (OTLP answers may be protobuf)."""
    if not resp.ok:
        raise reject(resp, what)
