"""The online routes of the gateway against a real nats-server and PostgreSQL: suites applied,
listed, read and deleted as events; bad suites refused naming the field; who may do what; fates
and stats read from the event store as the recorder folds `online.fate` events."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from evalbus.infra.postgres import create_database, drop_database
from evalbus.testing.pipeline import eventually
from evalbus_contracts import ObservationFate
from evalbus_gateway.testing import RunningGateway, member, running_gateway

pytestmark = pytest.mark.integration

ALICE = "tok-alice-online"


@pytest.fixture(scope="module")
async def gateway(gw_nats: str, pg_admin_url: str) -> AsyncIterator[RunningGateway]:
    url = await create_database(pg_admin_url, "evalbus_test")
    try:
        async with running_gateway(gw_nats, url, tokens={ALICE: member("alice")}) as gw:
            yield gw
    finally:
        await drop_database(pg_admin_url, url)


async def call(
    gw: RunningGateway, method: str, path: str, body: Any = None, token: str | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token or gw.admin_token}"}
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, gw.base_url + path, json=body, headers=headers) as resp,
    ):
        return resp.status, await resp.json()


def suite(suite_id: str, **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": suite_id,
        "target": {"service": "support-bot"},
        "sample_ratio": 0.25,
        "judges": [{"kind": "regex", "id": "polite", "pattern": "(?i)thank"}],
    }
    doc.update(changes)
    return doc


async def test_a_suite_is_applied_listed_read_replaced_and_deleted(gateway: RunningGateway) -> None:
    suite_id = f"s-{uuid.uuid4().hex[:8]}"
    status, applied = await call(gateway, "POST", "/v1/online/suites", suite(suite_id))
    assert status == 201, applied
    assert applied["suite"]["sample_ratio"] == 0.25
    assert applied["applied_by"] == "admin"
    status, listed = await call(gateway, "GET", "/v1/online/suites", token=ALICE)
    assert status == 200
    assert [i["suite"] for i in listed["items"] if i["suite"]["id"] == suite_id] == [applied["suite"]]
    status, _ = await call(gateway, "POST", "/v1/online/suites", suite(suite_id, sample_ratio=0.5))
    assert status == 201
    status, detail = await call(gateway, "GET", f"/v1/online/suites/{suite_id}", token=ALICE)
    assert status == 200, detail
    assert detail["suite"]["sample_ratio"] == 0.5  # the last applied holds
    assert (detail["metrics"], detail["fates"], detail["recent"]) == ([], [], [])
    status, deleted = await call(gateway, "DELETE", f"/v1/online/suites/{suite_id}")
    assert (status, deleted) == (200, {"suite_id": suite_id, "deleted": True})
    status, gone = await call(gateway, "GET", f"/v1/online/suites/{suite_id}")
    assert (status, gone["error"]["code"], gone["error"]["field"]) == (404, "not_found", "suite_id")
    status, listed = await call(gateway, "GET", "/v1/online/suites")
    assert suite_id not in [i["suite"]["id"] for i in listed["items"]]
    status, missing = await call(gateway, "DELETE", f"/v1/online/suites/{suite_id}")
    assert (status, missing["error"]["field"]) == (404, "suite_id")


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"id": ""}, "$.id", "suite id must not be empty"),
        ({"id": "x" * 300}, "$.id", "longer than 256"),
        ({"target": {}}, "$.target", "name a service, an agent, a workflow or an attribute"),
        ({"judges": []}, "$.judges", "at least one judge"),
        ({"judges": [{"kind": "regex", "id": "r", "pattern": "("}]}, "$.judges[0].pattern", ""),
        (
            {"judges": [{"kind": "exact", "id": "a"}, {"kind": "exact", "id": "a"}]},
            "$.judges[1].id",
            "duplicate judge id",
        ),
        ({"sample_ratio": 1.5}, "$.sample_ratio", "<= 1.0"),
        ({"sample_ratio": "half"}, "$.sample_ratio", "Expected `float`"),
        ({"judges": [{"kind": "nope", "id": "x"}]}, "$.judges[0].kind", "Invalid value 'nope'"),
    ],
)
async def test_a_bad_suite_is_refused_naming_the_field(
    gateway: RunningGateway, changes: dict[str, Any], field: str, message: str
) -> None:
    status, body = await call(gateway, "POST", "/v1/online/suites", suite("bad", **changes))
    assert status == 400, body
    assert body["error"]["field"] == field
    assert message in body["error"]["message"]


async def test_members_read_admins_change(gateway: RunningGateway) -> None:
    status, body = await call(gateway, "POST", "/v1/online/suites", suite("by-alice"), token=ALICE)
    assert (status, body["error"]["code"]) == (403, "forbidden")
    status, body = await call(gateway, "GET", "/v1/online/stats", token=ALICE)
    assert status == 200
    async with aiohttp.ClientSession() as http, http.get(gateway.base_url + "/v1/online/suites") as resp:
        assert resp.status == 401


async def test_fates_and_stats_come_from_the_recorded_events(gateway: RunningGateway) -> None:
    suite_id = f"f-{uuid.uuid4().hex[:8]}"
    trace_id = uuid.uuid4().hex
    other = uuid.uuid4().hex
    fates = [
        ObservationFate(
            observation_id=trace_id, trace_id=trace_id, suite_id=suite_id, fate="sampled", reason="sampled"
        ),
        ObservationFate(observation_id=other, trace_id=other, suite_id=suite_id, fate="skipped", reason="not_sampled"),
        ObservationFate(observation_id=other, trace_id=other, suite_id=None, fate="skipped", reason="no_suite"),
    ]
    await gateway.state.publisher.publish_events(fates)
    await gateway.state.publisher.publish_events(fates)  # a redelivery: deduplicated, counted once

    async def recorded() -> bool:
        _, stats = await call(gateway, "GET", f"/v1/online/stats?suite={suite_id}")
        return sum(int(c["count"]) for c in stats["counts"]) == 2

    await eventually(recorded, timeout_s=20, what="the fates to be recorded")
    _, stats = await call(gateway, "GET", f"/v1/online/stats?suite={suite_id}")
    assert sorted((c["fate"], c["reason"], c["count"]) for c in stats["counts"]) == [
        ("sampled", "sampled", 1),
        ("skipped", "not_sampled", 1),
    ]
    status, answer = await call(gateway, "GET", f"/v1/online/observations/{other}", token=ALICE)
    assert status == 200
    assert answer["status"] == "known"
    assert sorted((f["suite_id"] or "", f["reason"]) for f in answer["fates"]) == [
        ("", "no_suite"),
        (suite_id, "not_sampled"),
    ]
    _, unknown = await call(gateway, "GET", f"/v1/online/observations/{uuid.uuid4().hex}")
    assert (unknown["status"], unknown["fates"]) == ("unknown", [])
