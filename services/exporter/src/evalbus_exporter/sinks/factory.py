"""Build a sink from its spec: `jsonl` here, trace platforms through `evalbus_traces`."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from evalbus_contracts import JsonlSink, SinkSpec
from evalbus_exporter.sinks.base import CaseSink
from evalbus_exporter.sinks.jsonl import JsonlCaseSink
from evalbus_exporter.sinks.platform import PlatformCaseSink
from evalbus_runtime import SecretStore
from evalbus_traces import build_sink


class SinkBuilder:
    """Builds sinks; owns the HTTP session platform sinks share (open it with `start`)."""

    def __init__(self, export_dir: Path, secrets: SecretStore | None = None) -> None:
        self._export_dir = export_dir
        self._secrets = secrets or SecretStore()
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the shared HTTP session."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    async def close(self) -> None:
        """Close the shared HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def __call__(self, spec: SinkSpec, batch_id: str) -> CaseSink:
        """The sink for `spec` in batch `batch_id`."""
        if isinstance(spec, JsonlSink):
            return JsonlCaseSink(spec, batch_id, self._export_dir)
        if self._session is None:
            raise RuntimeError("SinkBuilder.start() was not awaited")
        return PlatformCaseSink(build_sink(spec, self._secrets, self._session))
