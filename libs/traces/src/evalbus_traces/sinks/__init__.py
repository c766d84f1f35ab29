"""Trace sinks, one module per platform: each exports judged cases and reports per-case outcomes.

`export_each` is the shared isolation contract: cases are exported one after another (the
exporter bounds concurrency across cases), and whatever one case raises becomes that case's
`failed` outcome — a sink never throws.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import aiohttp

from evalbus_contracts import PlatformSink
from evalbus_contracts.summary import SinkOutcome
from evalbus_runtime.secrets import SecretStore
from evalbus_traces.ports import ExportContext, JudgedCase
from evalbus_traces.transport import DEFAULT_TIMEOUT_S

ERROR_CAP = 500
"""Longest error text kept on an outcome."""


async def export_each(
    sink: str, cases: Sequence[JudgedCase], one: Callable[[JudgedCase], Awaitable[SinkOutcome]]
) -> list[SinkOutcome]:
    """`one(case)` for every case, in order; an exception becomes that case's failed outcome."""
    outcomes: list[SinkOutcome] = []
    for case in cases:
        try:
            outcomes.append(await one(case))
        except Exception as e:
            outcomes.append(SinkOutcome(sink=sink, status="failed", error=f"{type(e).__name__}: {e}"[:ERROR_CAP]))
    return outcomes


class HttpTraceSink:
    """What every platform sink shares: its spec, the HTTP session, the secret store, a timeout, and
    `export` = `_export_one` per case under `export_each`."""

    name = "platform"

    def __init__(
        self,
        spec: PlatformSink,
        session: aiohttp.ClientSession,
        secrets: SecretStore,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._spec = spec
        self._base = spec.endpoint.rstrip("/")
        self._session = session
        self._secrets = secrets
        self._timeout_s = timeout_s

    async def export(self, ctx: ExportContext, cases: Sequence[JudgedCase]) -> list[SinkOutcome]:
        """One outcome per case; never raises."""
        return await export_each(self.name, cases, lambda case: self._export_one(ctx, case))

    async def _export_one(self, ctx: ExportContext, case: JudgedCase) -> SinkOutcome:
        raise NotImplementedError
