"""The OpenAI-compatible chat-completions transport: one shared aiohttp session per process,
`POST {base_url}/chat/completions`, bounded retries on 429 (honouring `Retry-After`), 408 and
5xx, timeouts and dropped connections. With `ProviderLimits` every request holds a slot of its
provider's adaptive limit (`limits.py`) and tells it how the request went.

The API key is sent only in the `Authorization` header and is scrubbed from every detail this
module produces (a misbehaving server may echo the request back).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Literal

import aiohttp
import msgspec

from evalbus_judge.errors import JudgeMachineryError
from evalbus_judge.limits import Outcome, ProviderLimiter, ProviderLimits, quota_left, window_requests
from evalbus_runtime.secrets import SecretValue

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
"""Statuses worth another attempt; any other 5xx is retried too."""
BODY_EXCERPT = 300
"""Characters of an error body quoted in a failure detail."""

FailureKind = Literal["timeout", "rate_limited", "server_error", "connection", "client_error", "protocol"]
"""Why a completion produced no usable body."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long a completion may wait between attempts."""

    base_delay_s: float = 0.5
    """First backoff delay; doubles per retry (with jitter)."""
    max_delay_s: float = 20.0
    """Longest single backoff delay (a server's `Retry-After` is honoured up to the total budget)."""
    max_total_wait_s: float = 60.0
    """Most time spent waiting between attempts of one completion; beyond it the completion gives up."""

    def backoff(self, retry: int) -> float:
        """Delay before retry number `retry` (0-based): exponential, capped, equal jitter."""
        ceiling = min(self.max_delay_s, self.base_delay_s * (2.0**retry))
        return ceiling / 2 + random.uniform(0, ceiling / 2)


@dataclass(frozen=True, slots=True)
class ChatReply:
    """A 2xx response whose body is JSON."""

    body: Any
    """The decoded response body."""
    attempts: int
    """Requests made, including the successful one."""


@dataclass(frozen=True, slots=True)
class ChatFailure:
    """A completion that produced no usable body."""

    kind: FailureKind
    """Why."""
    detail: str
    """Human-readable explanation (never contains the API key)."""
    attempts: int
    """Requests made."""
    retryable: bool
    """Whether a later attempt could succeed."""


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header: delta seconds or an HTTP date; None when absent or malformed."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def redact(text: str, secret: SecretValue | None) -> str:
    """`text` with the secret's value replaced by `***`."""
    if secret is None:
        return text
    value = secret.reveal()
    return text.replace(value, "***") if value else text


class ChatClient:
    """The process's chat-completions client. `start()` in the service's start-up hook, `close()` on stop."""

    def __init__(self, retry: RetryPolicy | None = None, *, limits: ProviderLimits | None = None) -> None:
        self.retry = retry or RetryPolicy()
        self.limits = limits
        """Providers' adaptive limits (None: no limit but the judge service's own concurrency)."""
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the shared session (idempotent)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        """Close the shared session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> ChatClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def complete(
        self,
        *,
        base_url: str,
        payload: dict[str, Any],
        api_key: SecretValue | None,
        timeout_s: float,
        max_retries: int,
        path: str = "chat/completions",
    ) -> ChatReply | ChatFailure:
        """POST `payload` to `{base_url}/{path}` (chat completions; `embeddings` for the embedding
        judge), retrying transient failures.

        At most `1 + max_retries` requests that fail for another reason than a rate limit, each
        bounded by `timeout_s`: a 429 backs off (its `Retry-After`, else the policy's backoff)
        without spending a retry, so a provider that is only busy is waited for. All waits together
        are bounded by the retry policy's total budget. With provider limits, each request holds a
        slot of its provider's limit and a 429 waits in it (the pause is shared by every replica),
        bounded by the same budget. Never raises for anything the server or the network does;
        raises `JudgeMachineryError` when the client was not started.
        """
        session = self._session
        if session is None or session.closed:
            raise JudgeMachineryError("ChatClient.start() was not called")
        url = base_url.rstrip("/") + "/" + path
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key.reveal()}"
        data = msgspec.json.encode(payload)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        limiter = None if self.limits is None else self.limits.limiter(base_url, str(payload.get("model", "")))
        started = time.monotonic()
        waited = 0.0
        attempt = 0
        spent = 0  # retries spent on failures other than a rate limit
        limited = 0  # rate limits in a row (each backs off further)
        while True:
            attempt += 1
            outcome, retry_after = await self._limited_attempt(
                limiter, session, url, data, headers, timeout, attempt, api_key
            )
            if isinstance(outcome, ChatReply):
                return outcome
            failure = outcome
            if limiter is not None and failure.kind == "rate_limited":
                # the limiter paused the provider until its Retry-After and lowered the limit: the
                # next attempt waits for a slot there, not here
                if time.monotonic() - started > self.retry.max_total_wait_s:
                    return ChatFailure(
                        kind=failure.kind,
                        detail=f"{failure.detail}; giving up: rate limited for longer than the "
                        f"{self.retry.max_total_wait_s:.1f} s retry budget",
                        attempts=attempt,
                        retryable=True,
                    )
                continue
            if failure.kind == "rate_limited":
                limited += 1
                step = limited
            else:
                spent += 1
                limited = 0
                step = spent
            if not failure.retryable or spent > max_retries:
                return failure
            # each kind of failure backs off from its own count: a 500 after a run of 429s waits
            # like a first 500, not like the tenth attempt
            delay = retry_after if retry_after is not None else self.retry.backoff(step - 1)
            budget = self.retry.max_total_wait_s - waited
            if retry_after is None:
                delay = min(delay, budget)
            if delay > budget or budget <= 0:
                return ChatFailure(
                    kind=failure.kind,
                    detail=f"{failure.detail}; giving up: a {delay:.1f} s wait exceeds the remaining "
                    f"{max(budget, 0.0):.1f} s retry budget",
                    attempts=attempt,
                    retryable=True,
                )
            log.info("chat completion %s (attempt %d), retrying in %.2f s", failure.kind, attempt, delay)
            await asyncio.sleep(delay)
            waited += delay

    async def _limited_attempt(
        self,
        limiter: ProviderLimiter | None,
        session: aiohttp.ClientSession,
        url: str,
        data: bytes,
        headers: dict[str, str],
        client_timeout: aiohttp.ClientTimeout,
        attempt: int,
        api_key: SecretValue | None,
    ) -> tuple[ChatReply | ChatFailure, float | None]:
        """One request, holding a slot of its provider's limit (when there is one) and telling it how it went."""
        if limiter is None:
            outcome, retry_after, _, _ = await self._attempt(
                session, url, data, headers, client_timeout, attempt, api_key
            )
            return outcome, retry_after
        async with limiter.slot():
            outcome, retry_after, status, answer_headers = await self._attempt(
                session, url, data, headers, client_timeout, attempt, api_key
            )
        signal: Outcome = "other"
        if isinstance(outcome, ChatReply):
            signal = "ok"
        elif status in (429, 503):
            signal = "limited"
        await limiter.record(
            signal,
            retry_after_s=retry_after,
            remaining=quota_left(answer_headers),
            window=window_requests(answer_headers),
        )
        return outcome, retry_after

    async def _attempt(
        self,
        session: aiohttp.ClientSession,
        url: str,
        data: bytes,
        headers: dict[str, str],
        client_timeout: aiohttp.ClientTimeout,
        attempt: int,
        api_key: SecretValue | None,
    ) -> tuple[ChatReply | ChatFailure, float | None, int | None, dict[str, str]]:
        """One request: the reply or the failure, the server's `Retry-After` in seconds if it sent
        one (`retry-after-ms` first, as OpenAI sends it), the status and the response headers."""
        try:
            async with session.post(url, data=data, headers=headers, timeout=client_timeout) as response:
                body = await response.read()
                status = response.status
                answer_headers = {k.lower(): v for k, v in response.headers.items()}
        except TimeoutError:
            return (
                ChatFailure("timeout", f"no response within {client_timeout.total:g} s", attempt, True),
                None,
                None,
                {},
            )
        except aiohttp.ClientError as e:
            detail = redact(f"connection error: {type(e).__name__}: {e}", api_key)
            return ChatFailure("connection", detail, attempt, True), None, None, {}
        retry_after = _retry_after(answer_headers)
        excerpt = redact(body[:BODY_EXCERPT].decode("utf-8", "replace"), api_key)
        if 200 <= status < 300:
            try:
                return ChatReply(msgspec.json.decode(body), attempt), None, status, answer_headers
            except msgspec.DecodeError:
                failure = ChatFailure(
                    "protocol", f"HTTP {status} with a body that is not JSON: {excerpt}", attempt, False
                )
                return failure, None, status, answer_headers
        if status == 429:
            failure = ChatFailure("rate_limited", f"HTTP 429 rate limited: {excerpt}", attempt, True)
            return failure, retry_after, status, answer_headers
        if status in RETRY_STATUSES or status >= 500:
            return (
                ChatFailure("server_error", f"HTTP {status}: {excerpt}", attempt, True),
                retry_after,
                status,
                answer_headers,
            )
        return ChatFailure("client_error", f"HTTP {status}: {excerpt}", attempt, False), None, status, answer_headers


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait from `retry-after-ms` (milliseconds, OpenAI's) or `Retry-After`; None when neither parses."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms)
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value >= 0:
            return value / 1000.0
    return parse_retry_after(headers.get("retry-after"))
