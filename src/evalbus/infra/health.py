"""Health of a local stack: nats-server (its monitoring `/healthz` with JetStream), PostgreSQL
(connect and `select 1`) and each service (`/healthz` and `/readyz` on its HTTP port).

A component is healthy when its recorded process runs (for what `up` started) and it answers;
a service must be both live and ready. The checks return data; printing is the CLI's business.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import aiohttp
import asyncpg
import msgspec
from msgspec.structs import replace

from evalbus.infra.endpoints import SERVICES, Endpoints, ServiceEndpoint, redact_url
from evalbus.infra.processes import ProcessId, is_alive

_HTTP_TIMEOUT_S = 2.0
_PG_TIMEOUT_S = 3.0

ComponentKind = Literal["nats", "postgres", "service"]
"""What a component is."""


class ComponentHealth(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One component's health."""

    name: str
    """`nats`, `postgres` or a service name."""
    kind: ComponentKind
    """What it is."""
    healthy: bool
    """Whether it runs and answers (a service: live and ready)."""
    detail: str
    """Why, in a few words."""
    url: str | None = None
    """Where it listens (passwords redacted)."""
    pid: int | None = None
    """Its process, when `up` started it."""
    running: bool | None = None
    """Whether that process runs (None when it is not ours)."""
    live: bool | None = None
    """A service's `/healthz` answered 200."""
    ready: bool | None = None
    """A service's `/readyz` answered 200."""


class StackHealth(msgspec.Struct, frozen=True, kw_only=True):
    """Every component's health."""

    components: tuple[ComponentHealth, ...]
    """nats, postgres, then the services."""

    @property
    def healthy(self) -> bool:
        """Whether every component is healthy."""
        return all(c.healthy for c in self.components)

    def unhealthy(self) -> list[ComponentHealth]:
        """The components that are not healthy."""
        return [c for c in self.components if not c.healthy]


def _process_state(proc: ProcessId | None) -> tuple[bool, str]:
    if proc is None:
        return False, "not running"
    if not is_alive(proc):
        return False, f"not running (pid {proc.pid} is gone)"
    return True, ""


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int | None, str]:
    """Status code of GET `url` (None when it could not connect) and a short reason."""
    try:
        async with session.get(url) as resp:
            return resp.status, f"{resp.status}"
    except (aiohttp.ClientError, TimeoutError) as e:
        return None, type(e).__name__


async def check_nats(endpoints: Endpoints, session: aiohttp.ClientSession) -> ComponentHealth:
    """nats-server runs and its monitoring `/healthz?js-enabled-only=true` answers 200."""
    proc = endpoints.nats_process
    running, why = _process_state(proc)
    base = ComponentHealth(
        name="nats",
        kind="nats",
        url=endpoints.nats,
        pid=proc.pid if proc else None,
        running=running,
        healthy=False,
        detail=why,
    )
    if not running:
        return base
    if endpoints.nats_monitor is None:
        return replace(base, detail="no monitoring URL recorded")
    status, reason = await _get(session, f"{endpoints.nats_monitor}/healthz?js-enabled-only=true")
    if status != 200:
        return replace(base, detail=f"healthz: {reason}")
    return replace(base, healthy=True, detail="JetStream ready")


async def check_postgres(endpoints: Endpoints) -> ComponentHealth:
    """The embedded server runs (when it is ours) and the database answers `select 1`."""
    url = endpoints.database
    kind = endpoints.postgres or "external"
    base = ComponentHealth(
        name="postgres", kind="postgres", url=redact_url(url) if url else None, healthy=False, detail=kind
    )
    if kind == "embedded":
        proc = endpoints.postgres_process
        running, why = _process_state(proc)
        base = replace(base, pid=proc.pid if proc else None, running=running)
        if not running:
            return replace(base, detail=why)
    if url is None:
        return replace(base, detail="no database URL recorded")
    try:
        conn = await asyncpg.connect(url, timeout=_PG_TIMEOUT_S)
        try:
            one = await conn.fetchval("select 1", timeout=_PG_TIMEOUT_S)
        finally:
            await conn.close()
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
        return replace(base, detail=f"{type(e).__name__}: {e}")
    return replace(base, healthy=one == 1, detail=f"{kind}, select 1 ok")


async def check_service(name: str, svc: ServiceEndpoint, session: aiohttp.ClientSession) -> ComponentHealth:
    """The service's process runs and both `/healthz` and `/readyz` answer 200."""
    proc = svc.process
    running, why = _process_state(proc)
    base = ComponentHealth(
        name=name, kind="service", url=svc.http, pid=svc.pid, running=running, healthy=False, detail=why
    )
    if not running:
        return base
    (live_status, live_reason), (ready_status, ready_reason) = await asyncio.gather(
        _get(session, f"{svc.http}/healthz"), _get(session, f"{svc.http}/readyz")
    )
    live, ready = live_status == 200, ready_status == 200
    detail = "live, ready" if live and ready else f"healthz: {live_reason}, readyz: {ready_reason}"
    return replace(base, healthy=live and ready, live=live, ready=ready, detail=detail)


async def check_stack(endpoints: Endpoints, *, services: bool = True) -> StackHealth:
    """Check every component at once. With `services`, all five services are expected."""
    timeout = aiohttp.ClientTimeout(total=_HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        checks = [check_nats(endpoints, session), check_postgres(endpoints)]
        missing: list[ComponentHealth] = []
        for name in SERVICES if services else tuple(endpoints.services):
            svc = endpoints.services.get(name)
            if svc is None:
                missing.append(
                    ComponentHealth(name=name, kind="service", healthy=False, running=False, detail="not running")
                )
            else:
                checks.append(check_service(name, svc, session))
        found = await asyncio.gather(*checks)
    return StackHealth(components=(*found, *missing))
