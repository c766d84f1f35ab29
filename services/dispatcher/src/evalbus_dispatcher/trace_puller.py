"""The job-mode trace puller the dispatcher runs (`collect.TracePuller` over `evalbus_traces` sources)."""

from __future__ import annotations

import aiohttp

from evalbus_contracts import TraceEvent, TraceRef
from evalbus_runtime import MissingSecretError, SecretStore
from evalbus_traces import build_source, collect_trace
from evalbus_traces.errors import TraceUnavailableError


class PlatformTracePuller:
    """Job-mode collection: the harness's platform trace through an `evalbus_traces` source.

    An empty pull is retried (flush lag) and, still empty, gives the `error` event naming the
    correlation key; a hard error raises `TraceUnavailableError` (a retryable collect failure); a
    secret the reference names but the store lacks raises `MissingSecretError` — nothing was sent,
    and `execute_case` records the observation graders as `unmeasured: missing_secret`.
    """

    def __init__(self, secrets: SecretStore) -> None:
        self._secrets = secrets
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def pull(self, ref: TraceRef) -> list[TraceEvent]:
        assert self._session is not None
        outcome = await collect_trace(build_source(ref, self._secrets, self._session), ref)
        if outcome.status == "missing_secret":
            raise MissingSecretError(outcome.missing_secret or ref.auth_secret or "")
        if outcome.status == "unavailable":
            raise TraceUnavailableError(outcome.error or outcome.status)
        events = list(outcome.events)
        if outcome.error_event is not None:
            events.append(outcome.error_event)
        return events
