"""Bad input on every endpoint gets a 4xx JSON error naming the offending field — never a 500 or
a stack trace. One gateway (real nats-server, real PostgreSQL) serves the whole module."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest

from evalbus.infra.postgres import create_database, drop_database
from evalbus_api.models import ErrorBody
from evalbus_contracts import encode, to_builtins
from evalbus_gateway.api.routes import ROUTES
from evalbus_gateway.testing import ADMIN_TOKEN, BatchScript, RunningGateway, batch_spec, member, running_gateway

pytestmark = pytest.mark.integration

ALICE, BOB = "tok-alice", "tok-bob"
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
async def gateway(gw_nats: str, pg_admin_url: str) -> AsyncIterator[RunningGateway]:
    url = await create_database(pg_admin_url, "evalbus_test")
    try:
        async with running_gateway(
            gw_nats, url, tokens={ALICE: member("alice"), BOB: member("bob")}, max_request_bytes=LIMIT
        ) as gw:
            yield gw
    finally:
        await drop_database(pg_admin_url, url)


@pytest.fixture(scope="module")
async def batches(gateway: RunningGateway) -> dict[str, str]:
    """Two batches of alice's with their runs recorded: their ids and a cases cursor of the first."""
    out: dict[str, str] = {}
    async with aiohttp.ClientSession() as http:
        for name in ("one", "two"):
            async with http.post(
                f"{gateway.base_url}/v1/batches", json=to_builtins(batch_spec(("c1", "c2"))), headers=auth(ALICE)
            ) as resp:
                assert resp.status == 202
                out[name] = (await resp.json())["batch_id"]
            script = BatchScript(out[name], batch_spec(("c1", "c2")))
            for case in script.case_ids:
                await gateway.state.publisher.publish_event(script.case_requested(case))
        deadline = time.monotonic() + 20
        while True:
            async with http.get(
                f"{gateway.base_url}/v1/batches/{out['one']}/cases", params={"limit": "1"}, headers=auth(ALICE)
            ) as resp:
                cursor = (await resp.json())["next_cursor"]
            if cursor:
                out["cursor_one"] = cursor
                return out
            assert time.monotonic() < deadline, "runs recorded"
            await asyncio.sleep(0.02)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def spec(**changes: Any) -> dict[str, Any]:
    """A valid spec as JSON with `changes` applied at dotted paths (`policy.trials`)."""
    doc: dict[str, Any] = msgspec.json.decode(encode(batch_spec(("c1", "c2"))))
    for path, value in changes.items():
        node: Any = doc
        *parents, last = path.split(".")
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if isinstance(node, list):
            node[int(last)] = value
        elif value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return doc


_DELETE = object()


@dataclass(frozen=True)
class Bad:
    """One bad request and the error it must get."""

    name: str
    method: str
    path: str
    status: int
    code: str
    error_field: str | None
    json: Any = None
    data: bytes | None = None
    params: dict[str, str] = dataclasses.field(default_factory=dict)
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    token: str | None = ALICE


CASES: list[Bad] = [
    # ------------------------------------------------ POST /v1/batches
    Bad("malformed json", "POST", "/v1/batches", 400, "invalid_json", "$", data=b'{"suite": '),
    Bad("trailing garbage", "POST", "/v1/batches", 400, "invalid_json", "$", data=encode(batch_spec()) + b" x"),
    Bad("empty body", "POST", "/v1/batches", 400, "invalid_json", "$", data=b""),
    Bad("not utf-8", "POST", "/v1/batches", 400, "invalid_json", "$", data=b"\xff\xfe"),
    Bad("array body", "POST", "/v1/batches", 400, "invalid", "$", json=[]),
    Bad("missing harness", "POST", "/v1/batches", 400, "invalid", "$.harness", json=spec(harness=_DELETE)),
    Bad(
        "case id wrong type",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.suite.cases[0].id",
        json=spec(**{"suite.cases.0": {"id": 7, "input": "x"}}),
    ),
    Bad(
        "case id missing",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.suite.cases[1].id",
        json=spec(**{"suite.cases.1": {"input": "x"}}),
    ),
    Bad(
        "trials as string",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.policy.trials",
        json=spec(**{"policy.trials": "3"}),
    ),
    Bad(
        "unknown grader kind",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.suite.cases[0].graders[0].kind",
        json=spec(**{"suite.cases.0": {"id": "c1", "input": "x", "graders": [{"kind": "nope", "id": "g"}]}}),
    ),
    Bad("label not a string", "POST", "/v1/batches", 400, "invalid", "$.labels[...]", json=spec(labels={"a": 1})),
    Bad("no cases", "POST", "/v1/batches", 400, "invalid", "$.suite.cases", json=spec(**{"suite.cases": []})),
    Bad(
        "duplicate case ids",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.suite.cases[1].id",
        json=spec(**{"suite.cases": [{"id": "a", "input": "x"}, {"id": "a", "input": "y"}]}),
    ),
    Bad(
        "empty case id",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.suite.cases[0].id",
        json=spec(**{"suite.cases": [{"id": " ", "input": "x"}]}),
    ),
    Bad(
        "duplicate grader ids",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.suite.cases[0].graders[1].id",
        json=spec(
            **{
                "suite.cases.0": {
                    "id": "c1",
                    "input": "x",
                    "graders": [{"kind": "steps", "id": "g"}, {"kind": "cost", "id": "g"}],
                }
            }
        ),
    ),
    Bad(
        "judge id with a colon",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.judges[0].id",
        json=spec(judges=[{"kind": "exact", "id": "a:b"}]),
    ),
    Bad(
        "duplicate judge ids",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.judges[1].id",
        json=spec(judges=[{"kind": "exact", "id": "j"}, {"kind": "contains", "id": "j"}]),
    ),
    Bad("trials 0", "POST", "/v1/batches", 400, "invalid", "$.policy.trials", json=spec(**{"policy.trials": 0})),
    Bad("trials 101", "POST", "/v1/batches", 400, "invalid", "$.policy.trials", json=spec(**{"policy.trials": 101})),
    Bad("retries 11", "POST", "/v1/batches", 400, "invalid", "$.policy.retries", json=spec(**{"policy.retries": 11})),
    Bad("retries -1", "POST", "/v1/batches", 400, "invalid", "$.policy.retries", json=spec(**{"policy.retries": -1})),
    Bad(
        "negative concurrency",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.policy.concurrency",
        json=spec(**{"policy.concurrency": -1}),
    ),
    Bad(
        "per-batch concurrency (not built yet: refused, not ignored)",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.policy.concurrency",
        json=spec(**{"policy.concurrency": 2}),
    ),
    Bad(
        "command grader regex",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.suite.cases[0].graders[0].pass_pattern",
        json=spec(
            **{
                "suite.cases.0": {
                    "id": "c1",
                    "input": "x",
                    "graders": [{"kind": "command", "id": "g", "command": "true", "pass_pattern": "(unclosed"}],
                }
            }
        ),
    ),
    Bad(
        "text metric regex without a group",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.suite.cases[0].graders[0].pattern",
        json=spec(
            **{
                "suite.cases.0": {
                    "id": "c1",
                    "input": "x",
                    "graders": [{"kind": "text-metric", "id": "g", "pattern": "[0-9]+"}],
                }
            }
        ),
    ),
    Bad(
        "regex judge pattern",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.judges[0].pattern",
        json=spec(judges=[{"kind": "regex", "id": "r", "pattern": "a**"}]),
    ),
    Bad(
        "empty command",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "$.harness.command",
        json=spec(**{"harness.command": []}),
    ),
    Bad(
        "idempotency key too long",
        "POST",
        "/v1/batches",
        400,
        "invalid",
        "Idempotency-Key",
        json=spec(),
        headers={"Idempotency-Key": "k" * 201},
    ),
    Bad("huge body", "POST", "/v1/batches", 413, "payload_too_large", "$", data=b"[" + b"1," * LIMIT + b"1]"),
    # ------------------------------------------------ GET /v1/batches
    Bad("limit not a number", "GET", "/v1/batches", 400, "invalid", "limit", params={"limit": "ten"}),
    Bad("limit 0", "GET", "/v1/batches", 400, "invalid", "limit", params={"limit": "0"}),
    Bad("limit too large", "GET", "/v1/batches", 400, "invalid", "limit", params={"limit": "100000"}),
    Bad("garbage cursor", "GET", "/v1/batches", 400, "invalid_cursor", "cursor", params={"cursor": "%%%"}),
    Bad("base64 cursor of junk", "GET", "/v1/batches", 400, "invalid_cursor", "cursor", params={"cursor": "e30"}),
    # ------------------------------------------------ GET /v1/batches/{batch_id}
    Bad("unknown batch", "GET", "/v1/batches/bdoesnotexist", 404, "not_found", "batch_id"),
    Bad("batch id too long", "GET", "/v1/batches/" + "x" * 300, 400, "invalid", "batch_id"),
    Bad("another member's batch", "GET", "/v1/batches/{one}", 404, "not_found", "batch_id", token=BOB),
    # ------------------------------------------------ GET /v1/batches/{batch_id}/cases
    Bad("cases of unknown batch", "GET", "/v1/batches/bdoesnotexist/cases", 404, "not_found", "batch_id"),
    Bad("cases limit", "GET", "/v1/batches/{one}/cases", 400, "invalid", "limit", params={"limit": "-1"}),
    Bad("cases stage", "GET", "/v1/batches/{one}/cases", 400, "invalid", "stage", params={"stage": "bogus"}),
    Bad("cases cursor", "GET", "/v1/batches/{one}/cases", 400, "invalid_cursor", "cursor", params={"cursor": "!"}),
    Bad(
        "cursor of another list",
        "GET",
        "/v1/batches/{two}/cases",
        400,
        "invalid_cursor",
        "cursor",
        params={"cursor": "{cursor_one}"},
    ),
    # ------------------------------------------------ GET /v1/batches/{batch_id}/events
    Bad("events of unknown batch", "GET", "/v1/batches/bdoesnotexist/events", 404, "not_found", "batch_id"),
    Bad(
        "Last-Event-ID not a number",
        "GET",
        "/v1/batches/{one}/events",
        400,
        "invalid",
        "Last-Event-ID",
        headers={"Last-Event-ID": "abc"},
    ),
    Bad(
        "Last-Event-ID negative",
        "GET",
        "/v1/batches/{one}/events",
        400,
        "invalid",
        "Last-Event-ID",
        headers={"Last-Event-ID": "-4"},
    ),
    # ------------------------------------------------ POST /v1/batches/{batch_id}/cancel
    Bad("cancel unknown batch", "POST", "/v1/batches/bdoesnotexist/cancel", 404, "not_found", "batch_id"),
    Bad("cancel malformed json", "POST", "/v1/batches/{one}/cancel", 400, "invalid_json", "$", data=b"{"),
    Bad("cancel unknown field", "POST", "/v1/batches/{one}/cancel", 400, "invalid", "$.reason", json={"reason": "x"}),
    Bad("cancel not an object", "POST", "/v1/batches/{one}/cancel", 400, "invalid", "$", json=[1]),
    Bad("cancel huge body", "POST", "/v1/batches/{one}/cancel", 413, "payload_too_large", "$", data=b" " * (LIMIT + 1)),
    Bad("cancel another member's batch", "POST", "/v1/batches/{one}/cancel", 404, "not_found", "batch_id", token=BOB),
    # ------------------------------------------------ runs
    Bad("unknown run", "GET", "/v1/runs/evb-nope-c1", 404, "not_found", "run_id"),
    Bad("unknown trajectory", "GET", "/v1/runs/evb-nope-c1/trajectory", 404, "not_found", "run_id"),
    Bad("run id too long", "GET", "/v1/runs/" + "r" * 300, 400, "invalid", "run_id"),
    Bad("artifact of an unknown run", "GET", "/v1/runs/evb-nope-c1/artifacts/out.bin", 404, "not_found", "run_id"),
    Bad(
        "artifact name with a control character", "GET", "/v1/runs/evb-nope-c1/artifacts/a%01b", 400, "invalid", "name"
    ),
    # ------------------------------------------------ roles, methods, paths
    Bad("member on an admin route", "POST", "/v1/admin/read-models/rebuild", 403, "forbidden", "Authorization"),
    Bad(
        "a body where none is taken",
        "POST",
        "/v1/admin/read-models/rebuild",
        400,
        "invalid",
        "$",
        json={"x": 1},
        token=ADMIN_TOKEN,
    ),
    Bad("wrong method", "DELETE", "/v1/batches", 405, "method_not_allowed", "method"),
    Bad("wrong method on a batch", "PUT", "/v1/batches/{one}", 405, "method_not_allowed", "method"),
    Bad("unknown path", "GET", "/v1/nothing-here", 404, "not_found", "path"),
]


async def _send(
    http: aiohttp.ClientSession, gateway: RunningGateway, bad: Bad, ids: dict[str, str]
) -> tuple[int, bytes, str]:
    def fill(text: str) -> str:
        return text.format(**ids)

    headers = {**({"Authorization": f"Bearer {bad.token}"} if bad.token else {}), **bad.headers}
    kwargs: dict[str, Any] = {"headers": headers, "params": {k: fill(v) for k, v in bad.params.items()}}
    if bad.json is not None:
        kwargs["json"] = bad.json
    elif bad.data is not None:
        kwargs["data"] = bad.data
    async with http.request(bad.method, gateway.base_url + fill(bad.path), **kwargs) as resp:
        return resp.status, await resp.read(), resp.headers.get("Content-Type", "")


@pytest.mark.parametrize("bad", CASES, ids=[c.name for c in CASES])
async def test_bad_input_names_the_field(gateway: RunningGateway, batches: dict[str, str], bad: Bad) -> None:
    async with aiohttp.ClientSession() as http:
        status, body, content_type = await _send(http, gateway, bad, batches)
    assert status == bad.status, body
    assert content_type.startswith("application/json")
    assert b"Traceback" not in body
    error = msgspec.json.decode(body, type=ErrorBody).error
    assert (error.code, error.field) == (bad.code, bad.error_field), error.message
    assert error.message


async def test_chunked_huge_body_is_413(gateway: RunningGateway) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(LIMIT // 1024 + 2):
            yield b" " * 1024

    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{gateway.base_url}/v1/batches", data=chunks(), headers=auth(ALICE)) as resp,
    ):
        assert resp.status == 413
        error = msgspec.json.decode(await resp.read(), type=ErrorBody).error
    assert (error.code, error.field) == ("payload_too_large", "$")


AUTHENTICATED = [(m, r.openapi_path) for r in ROUTES if r.access != "public" for m in r.methods]


@pytest.mark.parametrize(("method", "path"), AUTHENTICATED, ids=[f"{m} {p}" for m, p in AUTHENTICATED])
async def test_every_v1_route_needs_a_token(
    gateway: RunningGateway, batches: dict[str, str], method: str, path: str
) -> None:
    fill = {"batch_id": batches["one"], "run_id": "evb-x-c1", "suite_id": "s1", "trace_id": "0" * 32, "name": "x.bin"}
    url = gateway.base_url + path.format(**fill)
    async with aiohttp.ClientSession() as http, http.request(method, url) as resp:
        assert resp.status == 401
        error = msgspec.json.decode(await resp.read(), type=ErrorBody).error
    assert (error.code, error.field) == ("unauthorized", "Authorization")


async def test_a_get_resource_answers_head_with_its_status_and_no_body(
    gateway: RunningGateway, batches: dict[str, str]
) -> None:
    one = batches["one"]
    async with aiohttp.ClientSession() as http:
        for path, token, status in [
            (f"/v1/batches/{one}", ALICE, 200),
            ("/v1/batches/bdoesnotexist", ALICE, 404),
            (f"/v1/batches/{one}", None, 401),
        ]:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with http.head(gateway.base_url + path, headers=headers) as resp:
                assert resp.status == status, path
                assert await resp.read() == b""
            async with http.get(gateway.base_url + path, headers=headers) as resp:
                assert resp.status == status, path
        async with http.head(gateway.base_url + f"/v1/batches/{one}/events", headers=auth(ALICE)) as resp:
            assert resp.status == 405  # an event stream has no head to give
