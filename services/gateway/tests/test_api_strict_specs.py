"""`POST /v1/batches` reads its body strictly: a misspelt key at any level is a 400 whose `field`
is the key's path and whose message names the intended key; a value outside its set lists the
allowed ones. The bus stays lenient: a `batch.requested` a newer release wrote, with fields this
gateway does not know, is still recorded. One gateway (real nats-server, real PostgreSQL) serves
the module."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from evalbus.infra.postgres import create_database, drop_database
from evalbus.testing.pipeline import eventually
from evalbus_api.models import ErrorBody
from evalbus_contracts import BatchRequested, encode
from evalbus_gateway.testing import RunningGateway, batch_spec, member, running_gateway
from evalbus_runtime.publisher import event_headers

pytestmark = pytest.mark.integration

ALICE = "tok-alice"


@pytest.fixture(scope="module")
async def gateway(gw_nats: str, pg_admin_url: str) -> AsyncIterator[RunningGateway]:
    url = await create_database(pg_admin_url, "evalbus_test")
    try:
        async with running_gateway(gw_nats, url, tokens={ALICE: member("alice")}) as gw:
            yield gw
    finally:
        await drop_database(pg_admin_url, url)


def spec_doc() -> dict[str, Any]:
    """A valid spec as JSON data, with one case that has a grader."""
    doc: dict[str, Any] = msgspec.json.decode(encode(batch_spec(("c1", "c2"))))
    doc["suite"]["cases"][0]["graders"] = [{"kind": "command", "id": "g", "command": "true"}]
    doc["judges"] = [{"kind": "exact", "id": "e"}]
    doc["sinks"] = [{"kind": "jsonl", "path": "{batch}.jsonl"}]
    return doc


def with_key(path: str, key: str, value: Any) -> dict[str, Any]:
    """`spec_doc()` with `key: value` added to the mapping at dotted `path` ('' is the root)."""
    doc = spec_doc()
    node: Any = doc
    for part in filter(None, path.split(".")):
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    node[key] = value
    return doc


async def post(gateway: RunningGateway, body: Any) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{gateway.base_url}/v1/batches", json=body, headers={"Authorization": f"Bearer {ALICE}"}) as resp,
    ):
        return resp.status, await resp.read()


TYPOS = [
    ("", "supersede_kye", "$.supersede_kye", "supersede_key"),
    ("suite", "descripton", "$.suite.descripton", "description"),
    ("suite.cases.1", "expeted", "$.suite.cases[1].expeted", "expected"),
    ("suite.cases.0", "grader", "$.suite.cases[0].grader", "graders"),
    ("suite.cases.0.graders.0", "timeout", "$.suite.cases[0].graders[0].timeout", "timeout_s"),
    ("harness", "comand", "$.harness.comand", "command"),
    ("harness.trace", "colect", "$.harness.trace.colect", "collect"),
    ("judges.0", "case_sensitiv", "$.judges[0].case_sensitiv", "case_sensitive"),
    ("sinks.0", "paht", "$.sinks[0].paht", "path"),
    ("policy", "trails", "$.policy.trails", "trials"),
]


@pytest.mark.parametrize(("at", "key", "field", "meant"), TYPOS, ids=[t[2] for t in TYPOS])
async def test_a_misspelt_key_is_400_naming_its_path_and_the_intended_key(
    gateway: RunningGateway, at: str, key: str, field: str, meant: str
) -> None:
    status, body = await post(gateway, with_key(at, key, 3))
    assert status == 400, body
    error = msgspec.json.decode(body, type=ErrorBody).error
    assert (error.code, error.field) == ("invalid", field)
    assert error.message == f"unknown field; did you mean `{meant}`?"


async def test_unknown_keys_come_before_the_errors_they_cause_and_are_counted(gateway: RunningGateway) -> None:
    doc = spec_doc()
    harness = doc["harness"]
    harness["comand"] = harness.pop("command")  # the missing `command` is explained by the typo
    doc["policy"] = {"trails": 2}
    status, body = await post(gateway, doc)
    assert status == 400, body
    error = msgspec.json.decode(body, type=ErrorBody).error
    assert error.field == "$.harness.comand"
    assert error.message == "unknown field; did you mean `command`? (and 1 more)"


async def test_a_value_outside_its_set_lists_the_allowed_ones(gateway: RunningGateway) -> None:
    doc = spec_doc()
    doc["judges"] = [{"kind": "contain", "id": "c"}]
    status, body = await post(gateway, doc)
    assert status == 400, body
    error = msgspec.json.decode(body, type=ErrorBody).error
    assert error.field == "$.judges[0].kind"
    assert error.message.startswith("Invalid value 'contain'; did you mean 'contains'? expected one of: ")
    assert "regex" in error.message


async def test_a_spec_with_every_key_right_is_accepted(gateway: RunningGateway) -> None:
    doc = spec_doc()
    doc["policy"] = {"trials": 2, "retries": 0, "concurrency": 0}
    doc["labels"] = {"any label": "is free-form"}
    status, body = await post(gateway, doc)
    assert status == 202, body


async def test_the_bus_still_reads_fields_it_does_not_know(gateway: RunningGateway) -> None:
    """A `batch.requested` from a newer release, with fields this gateway does not know in the event
    and in its embedded spec, is recorded: only user input is strict."""
    event = BatchRequested(batch_id="bfuture00001", spec=batch_spec(("c1",)), submitted_by="alice")
    raw: dict[str, Any] = msgspec.json.decode(encode(event))
    raw["spec"]["policy"]["fair_share"] = 3
    raw["spec"]["suite"]["cases"][0]["weight"] = 0.5
    raw["priority"] = "high"
    await gateway.state.publisher.publish_raw(event.subject(), msgspec.json.encode(raw), event_headers(event))

    async def recorded() -> bool:
        # The read model, not GET /v1/batches/{id}: that one would fill in from the stream.
        row = await gateway.state.pool.fetchrow("SELECT suite_id FROM batches WHERE batch_id = $1", event.batch_id)
        return row is not None and row["suite_id"] == "suite"

    await eventually(recorded, timeout_s=20, what="the newer batch.requested recorded into the read model")
