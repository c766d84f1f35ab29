"""A real gateway inside a test process: the chassis `Service` on a free port, talking to a real
nats-server and PostgreSQL (for the gateway's tests and cross-service tests alike), and
`BatchScript`, which builds the events the other services would publish for a batch, so a test
can drive the gateway through the bus without running them.

    async with running_gateway(nats_url, database_url, tokens={"t-alice": member("alice")}) as gw:
        url = gw.base_url
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from evalbus_api.client import SseEvent, SseParser
from evalbus_contracts import (
    BatchCancelled,
    BatchFinalized,
    BatchRequested,
    BatchSpec,
    BatchSummary,
    CaseExecuted,
    CaseExported,
    CaseJudged,
    CasePlan,
    CaseRequested,
    CaseResult,
    CaseSpec,
    CommandHarness,
    Measured,
    SuiteSpec,
    batch_run_id,
)
from evalbus_gateway.api.auth import ADMIN_PRINCIPAL, Principal, TokenTable
from evalbus_gateway.recorder_stage import RecordWith
from evalbus_gateway.service import build_gateway
from evalbus_gateway.settings import GatewaySettings
from evalbus_gateway.state import GatewayState
from evalbus_gateway.store import record
from evalbus_runtime import Service

ADMIN_TOKEN = "evalbus-test-admin-token"  # noqa: S105 - a test token, not a secret
"""The admin token of `running_gateway` unless given another."""


def member(name: str) -> Principal:
    """A member principal."""
    return Principal(name=name, role="member")


@dataclass(frozen=True, slots=True)
class RunningGateway:
    """A started gateway."""

    service: Service
    """The chassis service."""
    state: GatewayState
    """The gateway's state (pool, publisher, settings)."""
    admin_token: str
    """The admin bearer token."""

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:<port>`."""
        return f"http://{self.service.settings.http_host}:{self.service.http_port}"


@asynccontextmanager
async def running_gateway(
    nats_url: str,
    database_url: str,
    *,
    tokens: Mapping[str, Principal] | None = None,
    admin_token: str = ADMIN_TOKEN,
    record_with: RecordWith = record,
    **settings: Any,
) -> AsyncIterator[RunningGateway]:
    """Start a gateway (HTTP API + recorder) on a free loopback port; stop it on exit."""
    config = GatewaySettings(
        service="gateway",
        nats_url=nats_url,
        database_url=database_url,
        http_host="127.0.0.1",
        http_port=0,
        admin_token=admin_token,
        log_format="text",
        shutdown_timeout_s=10.0,
        **settings,
    )
    principals = dict(tokens or {})
    principals[admin_token] = Principal(name=ADMIN_PRINCIPAL, role="admin")
    service = Service(config)
    state = build_gateway(service, config, tokens=TokenTable(principals), record_with=record_with)
    await service.start()
    try:
        yield RunningGateway(service=service, state=state, admin_token=admin_token)
    finally:
        await service.stop()


HARNESS = CommandHarness(id="echo", command=("echo",))
"""The harness of `batch_spec`."""


def batch_spec(cases: tuple[str, ...] = ("c1", "c2"), *, supersede_key: str | None = None) -> BatchSpec:
    """A small valid batch spec."""
    return BatchSpec(
        suite=SuiteSpec(id="suite", cases=tuple(CaseSpec(id=c, input=f"task {c}") for c in cases)),
        harness=HARNESS,
        supersede_key=supersede_key,
    )


class BatchScript:
    """The events of one batch as the dispatcher, judge and exporter would publish them."""

    def __init__(self, batch_id: str, spec: BatchSpec | None = None, *, submitted_by: str = "alice") -> None:
        self.batch_id = batch_id
        self.spec = spec or batch_spec()
        self.submitted_by = submitted_by
        self.plan = CasePlan(suite_id=self.spec.suite.id, submitted_by=submitted_by)

    @property
    def case_ids(self) -> tuple[str, ...]:
        """The suite's case ids."""
        return tuple(c.id for c in self.spec.suite.cases)

    def run_id(self, case_id: str) -> str:
        """The run id of a case (one trial)."""
        return batch_run_id(self.batch_id, case_id)

    def _case(self, case_id: str) -> CaseSpec:
        return next(c for c in self.spec.suite.cases if c.id == case_id)

    def _result(self, case_id: str, passed: bool) -> CaseResult:
        score = Measured(grader_id="t", metric="tests_pass", value=1.0 if passed else 0.0, passed=passed)
        return CaseResult(case_id=case_id, run_id=self.run_id(case_id), harness="echo@1", answer="ok", scores=(score,))

    def requested(self) -> BatchRequested:
        """`batch.requested` (what the gateway publishes on submit)."""
        return BatchRequested(batch_id=self.batch_id, spec=self.spec, submitted_by=self.submitted_by)

    def case_requested(self, case_id: str) -> CaseRequested:
        """`case.requested`."""
        return CaseRequested(
            batch_id=self.batch_id,
            case_id=case_id,
            run_id=self.run_id(case_id),
            case=self._case(case_id),
            harness=self.spec.harness,
            plan=self.plan,
        )

    def executed(
        self, case_id: str, *, passed: bool = True, status: Literal["succeeded", "failed", "cancelled"] = "succeeded"
    ) -> CaseExecuted:
        """`case.executed`."""
        return CaseExecuted(
            batch_id=self.batch_id,
            case_id=case_id,
            run_id=self.run_id(case_id),
            status=status,
            result=self._result(case_id, passed),
            plan=self.plan,
            case=self._case(case_id),
        )

    def judged(self, case_id: str, *, passed: bool = True) -> CaseJudged:
        """`case.judged`."""
        return CaseJudged(
            batch_id=self.batch_id,
            case_id=case_id,
            run_id=self.run_id(case_id),
            status="judged",
            result=self._result(case_id, passed),
            plan=self.plan,
        )

    def exported(self, case_id: str) -> CaseExported:
        """`case.exported` (no sink: skipped)."""
        return CaseExported(batch_id=self.batch_id, case_id=case_id, run_id=self.run_id(case_id), status="skipped")

    def case_events(
        self, case_id: str, *, passed: bool = True
    ) -> list[CaseRequested | CaseExecuted | CaseJudged | CaseExported]:
        """A case through every stage."""
        return [
            self.case_requested(case_id),
            self.executed(case_id, passed=passed),
            self.judged(case_id, passed=passed),
            self.exported(case_id),
        ]

    def cancelled(self, by: str = "alice") -> BatchCancelled:
        """`batch.cancelled` (user cancel)."""
        return BatchCancelled(batch_id=self.batch_id, reason="cancelled", by=by)

    def finalized(
        self, status: Literal["succeeded", "failed", "cancelled", "superseded"] = "succeeded"
    ) -> BatchFinalized:
        """`batch.finalized` with an empty summary."""
        return BatchFinalized(batch_id=self.batch_id, status=status, summary=BatchSummary())


async def batch_events(
    http: aiohttp.ClientSession,
    gw: RunningGateway,
    batch_id: str,
    token: str,
    *,
    last_event_id: int | None = None,
    timeout_s: float | None = None,
) -> list[SseEvent]:
    """`GET /v1/batches/{batch_id}/events` read through its `end` event (the last one returned);
    AssertionError when the stream is refused or closes without it."""
    headers = {"Authorization": f"Bearer {token}"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    parser = SseParser()
    out: list[SseEvent] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with http.get(f"{gw.base_url}/v1/batches/{batch_id}/events", headers=headers, timeout=timeout) as resp:
        assert resp.status == 200, await resp.text()
        async for chunk in resp.content.iter_any():
            for event in parser.feed(chunk):
                out.append(event)
                if event.event == "end":
                    return out
    raise AssertionError(f"the stream of {batch_id} closed without its end after {len(out)} events")
