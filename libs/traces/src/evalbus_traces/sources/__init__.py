"""Trace sources, one module per platform: each turns a `TraceRef` into trace events."""

from __future__ import annotations

import aiohttp

from evalbus_runtime.secrets import SecretStore
from evalbus_traces.transport import DEFAULT_TIMEOUT_S


class HttpTraceSource:
    """What every platform source shares: the HTTP session, the secret store and a timeout."""

    def __init__(self, session: aiohttp.ClientSession, secrets: SecretStore, timeout_s: float = DEFAULT_TIMEOUT_S):
        self._session = session
        self._secrets = secrets
        self._timeout_s = timeout_s
