"""The gateway fuzzed from its own OpenAPI document (schemathesis): for every operation of
`/openapi.json` (the streaming ones aside, see below), generated requests — valid ones and ones
that break the schema: ids with control characters, very long and non-UTF-8 path segments, wrong
content types, bodies of the wrong shape — get no server error (5xx), and every 4xx carries the
documented error body naming the offending field. Each operation runs with the admin token and
with a member's, a bounded number of examples, from a fixed seed, so a run is reproducible.

The streaming operations (the SSE routes and `/mcp`, which would hold a connection open for as
long as a stream lives) are left out of the generated part and get their bad input by hand,
together with what generators rarely produce: deep JSON nesting, huge numbers, duplicate keys,
broken escapes, non-UTF-8 bytes in headers, and the HTTP parser's own refusals. Each case here
was a 500 once, fixed in the gateway, and stays as a regression test.

Stateful sequences follow the document's OpenAPI links (schemathesis' state machine): a batch
submitted → read → its runs read → cancelled; online suites applied → listed → read → deleted → read
again; a dataset uploaded → a batch naming it — each step's values from the responses before it,
with the same two checks on every response, a bounded number of scenarios from a fixed seed. Every
link out of a batch's answers (the batch, its runs, a run, its trajectory and logs, the next page,
cancelling) is also walked from a real batch, deterministically, each one to a 2xx.

The gateway runs in a thread of its own (its own event loop), because schemathesis drives its
requests synchronously; it talks to a real nats-server and a real PostgreSQL database.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import hypothesis
import msgspec
import pytest
import requests
import schemathesis
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from evalbus.infra.postgres import create_database, drop_database
from evalbus_api.models import ErrorBody
from evalbus_contracts import BatchSpec, to_builtins
from evalbus_gateway.api.openapi import build_openapi
from evalbus_gateway.api.routes import ROUTES
from evalbus_gateway.api.table import Route
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_spec, member, running_gateway

pytestmark = pytest.mark.integration

SEED = 20261201
"""Every run generates the same requests."""
MAX_EXAMPLES = 25
"""Generated requests per operation, per token (plus schemathesis' coverage cases)."""
ALICE, BOB = "tok-fuzz-alice", "tok-fuzz-bob"
LIMIT = 64 * 1024
"""The gateway's body limit here (small, so 413 is cheap to reach)."""


def _streams(route: Route) -> bool:
    ok = route.responses.get(200)
    sse = ok is not None and ok.content_type == "text/event-stream"
    return sse or route.tag == "mcp" or 101 in route.responses  # SSE, MCP, a WebSocket


STREAMING = frozenset(r.operation_id for r in ROUTES if _streams(r))
"""Operations left out of the generated part: they hold the connection for a stream's life
(server-sent events, MCP, the terminal's WebSocket)."""


# ---------------------------------------------------------------- a gateway in a thread


@dataclass
class ThreadedGateway:
    """A gateway serving from a background thread's event loop."""

    gateway: RunningGateway
    loop: asyncio.AbstractEventLoop

    @property
    def base_url(self) -> str:
        return self.gateway.base_url

    def run(self, coro: Any) -> Any:
        """Run `coro` on the gateway's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)


@pytest.fixture(scope="module")
def gateway(gw_nats: str, pg_admin_url: str) -> Iterator[ThreadedGateway]:
    started: Future[ThreadedGateway] = Future()
    stop = threading.Event()

    async def serve() -> None:
        url = await create_database(pg_admin_url, "evalbus_fuzz")
        try:
            async with running_gateway(
                gw_nats, url, tokens={ALICE: member("alice"), BOB: member("bob")}, max_request_bytes=LIMIT
            ) as gw:
                started.set_result(ThreadedGateway(gateway=gw, loop=asyncio.get_running_loop()))
                while not stop.is_set():
                    await asyncio.to_thread(stop.wait, 0.5)
        finally:
            await drop_database(pg_admin_url, url)

    def main() -> None:
        try:
            asyncio.run(serve())
        except BaseException as e:
            if not started.done():
                started.set_exception(e)
            raise

    thread = threading.Thread(target=main, name="fuzzed-gateway", daemon=True)
    thread.start()
    served = started.result(timeout=60)
    try:
        yield served
    finally:
        stop.set()
        thread.join(timeout=60)


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def seeded(gateway: ThreadedGateway) -> dict[str, str]:
    """A batch of alice's with its runs recorded (so some generated ids and reads hit real rows)."""
    resp = requests.post(
        f"{gateway.base_url}/v1/batches", json=to_builtins(batch_spec(("c1", "c2"))), headers=_auth(ALICE), timeout=30
    )
    assert resp.status_code == 202, resp.text
    batch_id = resp.json()["batch_id"]
    script = BatchScript(batch_id, batch_spec(("c1", "c2")))
    for case in script.case_ids:
        gateway.run(gateway.gateway.state.publisher.publish_event(script.case_requested(case)))
    deadline = time.monotonic() + 30
    while True:
        cases = requests.get(f"{gateway.base_url}/v1/batches/{batch_id}/cases", headers=_auth(ALICE), timeout=30)
        if cases.status_code == 200 and len(cases.json()["cases"]) == 2:
            return {"batch_id": batch_id, "run_id": script.run_id("c1"), "suite_id": script.spec.suite.id}
        assert time.monotonic() < deadline, f"runs of {batch_id} recorded"
        time.sleep(0.05)  # polling an observable condition with a deadline


# ---------------------------------------------------------------- the generated part


@schemathesis.check
def error_body_names_the_field(ctx: schemathesis.CheckContext, response: schemathesis.Response, case: Any) -> bool:
    """Every 4xx is the documented error body — a code, a message and the offending field."""
    if not 400 <= response.status_code < 500:
        return True
    try:
        error = msgspec.json.decode(response.content, type=ErrorBody).error
    except msgspec.DecodeError as e:
        raise AssertionError(f"a {response.status_code} without the error body: {response.content[:200]!r}") from e
    assert error.code, "the error has a code"
    assert error.message, "the error has a message"
    assert error.field, f"the {response.status_code} {error.code!r} names its field ({error.message!r})"
    return True


def _config(*, stateful: bool = False) -> schemathesis.Config:
    """The generation settings; the stateful phase only for the state machine (the parametrized
    tests call one operation each)."""
    return schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "generation": {
                "max-examples": MAX_EXAMPLES,
                "mode": "all",
                "deterministic": True,
                "with-security-parameters": False,
                "database": "none",
            },
            # the stateful phase follows the document's own links only (no inferred ones)
            "phases": {"stateful": {"enabled": stateful, "inference": {"algorithms": []}}},
            "suppress-health-check": ["too_slow", "filter_too_much", "data_too_large"],
        }
    )


_JSONL = st.lists(
    st.dictionaries(st.sampled_from(["id", "input", "expected", "graders", "tags", "inputs"]), st.text(max_size=8))
    | st.text(max_size=20),
    max_size=4,
).map(lambda rows: b"\n".join(msgspec.json.encode(r) for r in rows))
schemathesis.openapi.media_type("application/x-ndjson", _JSONL | st.binary(max_size=200))
"""Dataset uploads (`POST /v1/datasets`): JSONL rows near a case's shape, and arbitrary bytes."""

DOCUMENT: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(build_openapi(ROUTES)))
"""The document `/openapi.json` serves (generated from the same route table; a test checks)."""
schema = schemathesis.openapi.from_dict(DOCUMENT, config=_config()).exclude(operation_id=sorted(STREAMING))
"""Its operations, without the streaming ones."""
CHECKS = [not_a_server_error, error_body_names_the_field]


# ---------------------------------------------------------------- stateful: following the links

STATEFUL_STEPS = 6
"""Calls per scenario at most."""
_BATCH, _RUNS = ("POST /v1/batches", "GET /v1/batches/{batch_id}"), "GET /v1/batches/{batch_id}/cases"
_SUITE = ("POST /v1/online/suites", "GET /v1/online/suites/{suite_id}")
REQUIRED_STEPS: dict[str, tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]] = {
    "batches": (
        (_BATCH[:1], _BATCH[1:]),  # a batch submitted, then read
        (_BATCH, ("POST /v1/batches/{batch_id}/cancel",)),  # cancelled
        (("POST /v1/datasets",), _BATCH[:1]),  # a dataset uploaded, then a batch naming it
    ),
    "online suites": (
        (_SUITE[:1], ("GET /v1/online/suites",)),  # applied, then listed
        (_SUITE[:1], _SUITE[1:]),  # read
        (_SUITE, ("DELETE /v1/online/suites/{suite_id}",)),  # deleted
    ),
}
"""Per machine, the linked steps (any of the sources → any of the targets, both answered 2xx) its
scenarios must take, so the stateful run cannot quietly degrade into unrelated single calls. The
steps through a batch's run listing (batch → its runs → a run) are two links deep behind a valid
batch, so whether a bounded run draws them moved with changes that did not touch the API: their
links are walked from a real batch, every one of them, by `test_every_link_of_a_real_batch_*`."""

_IDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
_VALID_BATCHES = st.builds(
    lambda suite, cases, with_cases: (
        to_builtins(
            msgspec.structs.replace(
                batch_spec(tuple(cases)), suite=msgspec.structs.replace(batch_spec(tuple(cases)).suite, id=suite)
            )
        )
        if with_cases
        else {"suite": {"id": suite}, "harness": to_builtins(batch_spec().harness)}
    ),
    _IDS,
    st.lists(_IDS, min_size=1, max_size=3, unique=True),
    st.booleans(),
)
"""Specs the gateway accepts (a suite without cases: one a dataset link completes)."""
_SUITE_SERIAL = itertools.count()
_VALID_ONLINE_SUITES = st.builds(
    lambda suite, service, ratio: {
        # a new suite each time, so what an earlier scenario deleted does not change a later one
        "id": f"{suite}-{next(_SUITE_SERIAL)}",
        "target": {"service": service},
        "judges": [{"kind": "exact", "id": "exact"}],
        "sample_ratio": ratio,
    },
    _IDS,
    _IDS,
    st.sampled_from([0.0, 0.5, 1.0]),
)
_VALID_DATASETS = st.lists(_IDS, min_size=1, max_size=3, unique=True).map(
    lambda ids: b"\n".join(msgspec.json.encode({"id": i, "input": f"task {i}"}) for i in ids)
)


def _valid_half_the_time(valid: st.SearchStrategy[Any]) -> Any:
    """A `flatmap_body` hook: the generated body, or one the gateway accepts — so the links out of a
    creation are followed from real resources, not only from refusals."""

    def hook(ctx: Any, body: Any) -> st.SearchStrategy[Any]:
        return st.one_of(valid, st.just(body))  # the accepted one first: Hypothesis starts simple

    return hook


_stateful = schemathesis.openapi.from_dict(DOCUMENT, config=_config(stateful=True))
_stateful.hook("flatmap_body").apply_to(operation_id="submitBatch")(_valid_half_the_time(_VALID_BATCHES))  # type: ignore[attr-defined]
_stateful.hook("flatmap_body").apply_to(operation_id="applyOnlineSuite")(_valid_half_the_time(_VALID_ONLINE_SUITES))  # type: ignore[attr-defined]
_stateful.hook("flatmap_body").apply_to(operation_id="uploadDataset")(_valid_half_the_time(_VALID_DATASETS))  # type: ignore[attr-defined]


_NARROWING = ("cursor", "stage", "limit")
"""Query parameters of a run listing whose generated values keep its page from listing runs: a
made-up `cursor` points nowhere (a real one comes from a page's `next_cursor`), a `stage` other
than `requested` matches none of the fixture's runs (`fan_out` records only their requests), and
a `limit` out of range is refused."""


def _a_full_page_first(ctx: Any, query: Any) -> st.SearchStrategy[Any]:
    """A `flatmap_query` hook: a run listing half the time without the `_NARROWING` parameters, so
    its page lists runs and the links to them (`cases/0/run_id`) lead to real ones; the generated
    query still comes the other half, and the parametrized tests fuzz those parameters at length."""
    if not isinstance(query, dict) or not any(k in query for k in _NARROWING):
        return st.just(query)
    return st.one_of(st.just({k: v for k, v in query.items() if k not in _NARROWING}), st.just(query))


_stateful.hook("flatmap_query").apply_to(operation_id="listBatchCases")(_a_full_page_first)  # type: ignore[attr-defined]
MACHINES = {
    "batches": _stateful.include(
        operation_id=[
            "submitBatch",
            "getBatch",
            "listBatchCases",
            "cancelBatch",
            "getRun",
            "getRunTrajectory",
            "getRunLogs",
            "uploadDataset",
        ]
    ),
    "online suites": _stateful.include(
        operation_id=["applyOnlineSuite", "listOnlineSuites", "getOnlineSuite", "deleteOnlineSuite"]
    ),
}
"""The linked operations of each resource family, one state machine each (so a bounded number of
scenarios covers every family's links)."""


PAGE = 1000
"""Runs read per page while waiting for a generated batch's runs (a generated suite may have more)."""


def fan_out(gateway: ThreadedGateway, token: str, batch_id: str, body: Any) -> None:
    """Stand in for the dispatcher's fan-out of an accepted batch (`case.requested` per inline case)
    and wait until the gateway shows its runs, so the links to its runs lead somewhere.

    The batch may already have runs: a generated `Idempotency-Key` an earlier scenario sent gives
    the same batch id again, so the wait is for this body's cases to be among the batch's, not
    for the batch to hold exactly them."""
    script = BatchScript(batch_id, msgspec.convert(body, BatchSpec))
    for case in script.case_ids:
        gateway.run(gateway.gateway.state.publisher.publish_event(script.case_requested(case)))
    wanted = set(script.case_ids)
    deadline = time.monotonic() + 30
    while True:
        cases = requests.get(
            f"{gateway.base_url}/v1/batches/{batch_id}/cases?limit={PAGE}", headers=_auth(token), timeout=30
        )
        listed = {c["case_id"] for c in cases.json()["cases"]} if cases.status_code == 200 else set()
        if wanted <= listed or len(listed) >= PAGE:
            return
        assert time.monotonic() < deadline, (
            f"runs of {batch_id} recorded: GET …/cases answered {cases.status_code}, "
            f"listing {sorted(listed)[:10]} ({len(listed)}), waiting for {sorted(wanted - listed)[:10]}"
        )
        time.sleep(0.02)  # polling an observable condition with a deadline


def run_linked_scenarios(
    gateway: ThreadedGateway, machine_name: str, token: str, scenarios: int
) -> Counter[tuple[str, str]]:
    """Run machine `machine_name` against the gateway with `token` for `scenarios` scenarios: no
    response may fail a check (every failure is kept, whatever Hypothesis does next); the
    (source, target) of every linked step answered 2xx after a 2xx source."""
    followed: Counter[tuple[str, str]] = Counter()
    failures: list[str] = []
    machine = MACHINES[machine_name].as_state_machine()

    class AgainstTheGateway(machine):  # type: ignore[misc,valid-type]
        def setup(self) -> None:
            self.answered: dict[str, tuple[str, int]] = {}

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": gateway.base_url, "headers": _auth(token), "timeout": 30}

        def step(self, input: Any) -> Any:
            output = super().step(input)
            label = f"{input.case.method.upper()} {input.case.path}"
            status = output.response.status_code
            self.answered[input.case.id] = (label, status)
            source = self.answered.get(input.transition.parent_id) if input.transition is not None else None
            if source is not None and source[1] < 300 and status < 300:
                followed[(source[0], label)] += 1
            elif source is not None and source[1] < 300:
                TRIED[(source[0], label, status, output.response.text[:160])] += 1
            if label == "POST /v1/batches" and status == 202:
                fan_out(gateway, token, output.response.json()["batch_id"], input.case.body)
            return output

        def validate_response(self, response: Any, case: Any, additional_checks: Any = None, **kwargs: Any) -> None:
            try:
                case.validate_response(response, checks=CHECKS, transport_kwargs=kwargs or None)
            except Exception as e:
                failures.append(f"{case.method.upper()} {case.formatted_path} -> {response.status_code}: {e}")
                raise

    AgainstTheGateway.run(
        settings=hypothesis.settings(
            max_examples=scenarios,
            stateful_step_count=STATEFUL_STEPS,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
            # generation only: the API's state changes under the scenarios (each adds batches and
            # suites), so a scenario replayed to shrink it would not draw the same steps again
            phases=[hypothesis.Phase.generate],
        )
    )
    assert not failures, "\n".join(failures)
    return followed


TRIED: Counter[tuple[str, str, int, str]] = Counter()
"""Linked steps from a 2xx source that were not 2xx themselves (what a failure of a required step
shows: why the link led nowhere)."""

ROUNDS = 3
"""Rounds of scenarios a family gets before a required step still not taken fails the test (all
from the fixed seed, each round drawing more scenarios than the one before)."""


def missing_steps(
    machine_name: str, followed: Counter[tuple[str, str]]
) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """The steps of `REQUIRED_STEPS[machine_name]` never followed."""
    return [
        (sources, targets)
        for sources, targets in REQUIRED_STEPS[machine_name]
        if not any(followed[(a, b)] for a in sources for b in targets)
    ]


def test_openapi_document_is_the_served_one(gateway: ThreadedGateway) -> None:
    served = requests.get(f"{gateway.base_url}/openapi.json", timeout=30).json()
    assert served == DOCUMENT


@schema.parametrize()
def test_generated_requests_as_admin(case: Any, gateway: ThreadedGateway, seeded: dict[str, str]) -> None:
    case.call_and_validate(
        base_url=gateway.base_url, headers=_auth(gateway.gateway.admin_token), checks=CHECKS, timeout=30
    )


@schema.parametrize()
def test_generated_requests_as_member(case: Any, gateway: ThreadedGateway, seeded: dict[str, str]) -> None:
    case.call_and_validate(base_url=gateway.base_url, headers=_auth(ALICE), checks=CHECKS, timeout=30)


@pytest.mark.parametrize(("machine", "scenarios"), [("batches", 30), ("online suites", 15)])
def test_linked_sequences_as_admin(
    gateway: ThreadedGateway, seeded: dict[str, str], machine: str, scenarios: int
) -> None:
    """Sequences along the links, as an admin (who may also apply and delete online suites): no 5xx,
    every 4xx naming its field, and every step of `REQUIRED_STEPS` really taken."""
    followed: Counter[tuple[str, str]] = Counter()
    for round_ in range(ROUNDS):  # the state the scenarios meet depends on the module's earlier tests:
        token = gateway.gateway.admin_token
        followed += run_linked_scenarios(gateway, machine, token, scenarios * (round_ + 1))
        missing = missing_steps(machine, followed)
        if not missing:  # a required step may need another round of scenarios to be drawn
            break
    tried = [t for t in TRIED.items() if any(t[0][:2] in ((a, b) for a in m[0] for b in m[1]) for m in missing)]
    assert not missing, (
        f"never followed to a 2xx: {missing}; followed: {sorted(followed.items())}; "
        f"those steps tried: {sorted(tried)[:10]}"
    )


def resolve(expression: str, *, body: Any, path: dict[str, str]) -> Any:
    """The value of an OpenAPI runtime expression against a source's answer and request:
    `$response.body#/json/pointer` or `$request.path.<name>` (the two forms the document uses)."""
    if expression.startswith("$request.path."):
        return path[expression.removeprefix("$request.path.")]
    prefix = "$response.body#"
    assert expression.startswith(prefix), f"a runtime expression this walk does not know: {expression}"
    value = body
    for raw in expression.removeprefix(prefix).strip("/").split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        value = value[int(token)] if isinstance(value, list) else value[token]
    return value


def test_every_link_of_a_real_batch_leads_to_a_2xx(gateway: ThreadedGateway) -> None:
    """From a batch submitted with two cases (its runs recorded), every OpenAPI link of every answer
    on the way is followed, its parameters taken from that answer as the document says: the batch,
    its runs (a page of one, so `nextPage` has a cursor), the first run, its trajectory and logs,
    the next page, cancelling. Each must answer 2xx; the walk is deterministic, so a link that stops
    leading anywhere fails here whatever the stateful run draws."""
    operations = {
        op["operationId"]: (method.upper(), path, op)
        for path, item in DOCUMENT["paths"].items()
        for method, op in item.items()
    }
    body = to_builtins(batch_spec(("w1", "w2")))
    submitted = requests.post(f"{gateway.base_url}/v1/batches", json=body, headers=_auth(ALICE), timeout=30)
    assert submitted.status_code == 202, submitted.text
    fan_out(gateway, ALICE, submitted.json()["batch_id"], body)

    followed: dict[tuple[str, str], int] = {}
    # (operation, path parameters, query, its answer); cancelling goes last, as it changes the batch
    frontier: list[tuple[str, dict[str, str], dict[str, Any], Any]] = [("submitBatch", {}, {}, submitted.json())]
    while frontier:
        source, source_path, _, answer = frontier.pop(0)
        responses = operations[source][2]["responses"]
        links = next(r.get("links", {}) for status, r in responses.items() if status.startswith("2"))
        for name, link in sorted(links.items(), key=lambda kv: kv[1]["operationId"] == "cancelBatch"):
            if (source, name) in followed:
                continue
            method, template, target = operations[link["operationId"]]
            where = {p["name"]: p["in"] for p in target.get("parameters", [])}
            values = {k: resolve(v, body=answer, path=source_path) for k, v in link["parameters"].items()}
            path_params = {k: str(v) for k, v in values.items() if where[k] == "path"}
            query = {k: v for k, v in values.items() if where[k] == "query"}
            if link["operationId"] == "listBatchCases" and "cursor" not in query:
                query["limit"] = 1  # a page of one of the two runs: its `nextPage` link has a cursor
            url = gateway.base_url + template.format(**path_params)
            answered = requests.request(method, url, params=query, headers=_auth(ALICE), timeout=30)
            assert answered.status_code < 300, (source, name, url, query, answered.status_code, answered.text[:300])
            followed[(source, name)] = answered.status_code
            if answered.headers.get("Content-Type", "").startswith("application/json"):
                frontier.append((link["operationId"], path_params, query, answered.json()))
        frontier.sort(key=lambda f: f[0] == "cancelBatch")
    assert {
        ("submitBatch", "getBatch"),
        ("submitBatch", "listBatchCases"),
        ("submitBatch", "cancelBatch"),
        ("getBatch", "listBatchCases"),
        ("listBatchCases", "getRun"),
        ("listBatchCases", "getRunTrajectory"),
        ("listBatchCases", "getRunLogs"),
        ("listBatchCases", "nextPage"),
    } <= set(followed), sorted(followed)


def test_linked_sequences_as_member(gateway: ThreadedGateway, seeded: dict[str, str]) -> None:
    """The batch sequences as a member (who sees only its own batches): the same two checks."""
    followed: Counter[tuple[str, str]] = Counter()
    for round_ in range(ROUNDS):  # as for the admin: another round when the step was not drawn
        followed += run_linked_scenarios(gateway, "batches", ALICE, 15 * (round_ + 1))
        if followed[("POST /v1/batches", "GET /v1/batches/{batch_id}")]:
            break
    assert followed[("POST /v1/batches", "GET /v1/batches/{batch_id}")], dict(followed)


# ---------------------------------------------------------------- by hand


@dataclass(frozen=True)
class Answer:
    """An HTTP answer as it came over the socket."""

    status: int
    content_type: str
    body: bytes

    def error(self) -> Any:
        assert self.content_type.startswith("application/json"), (self.status, self.content_type, self.body[:200])
        return msgspec.json.decode(self.body, type=ErrorBody).error


def send_raw(base_url: str, method: str, target: bytes, *, headers: dict[bytes, bytes], body: bytes = b"") -> Answer:
    """One request written byte for byte (so a header or a path may hold bytes no client library
    sends); the answer is read to its Content-Length, or until the server closes the connection."""
    host, port = base_url.removeprefix("http://").split(":")
    head = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: " + host.encode()]
    if not any(k.lower() == b"connection" for k in headers):
        head.append(b"Connection: close")
    head += [k + b": " + v for k, v in headers.items()]
    if body or method in ("POST", "PUT", "PATCH"):
        head.append(b"Content-Length: %d" % len(body))
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        raw = b""
        while b"\r\n\r\n" not in raw and (chunk := sock.recv(65536)):
            raw += chunk
        header_block, _, payload = raw.partition(b"\r\n\r\n")
        lines = header_block.split(b"\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
        length = fields.get(b"content-length")
        while (length is None or len(payload) < int(length)) and (chunk := sock.recv(65536)):
            payload += chunk
    status = int(lines[0].split()[1])
    if fields.get(b"transfer-encoding") == b"chunked":
        payload = _dechunk(payload)
    return Answer(status=status, content_type=fields.get(b"content-type", b"").decode("latin-1"), body=payload)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)


def _bearer(token: str) -> dict[bytes, bytes]:
    return {b"Authorization": b"Bearer " + token.encode()}


def _path_cases() -> list[tuple[str, str, str, str, bytes]]:
    """(method, path template, parameter, kind, bad value) for every path parameter of every route."""
    bad = {
        "nul": b"a%00b",
        "control": b"a%01b",
        "newline": b"a%0Ab",
        "delete": b"a%7Fb",
        "non-utf-8": b"%FF%FE%FD",
        "overlong utf-8": b"%C0%AF",
        "long": b"x" * 4000,
    }
    out = []
    for route in ROUTES:
        for param in (p for p in route.params if p.location == "path"):
            for method in route.methods:
                for name, value in bad.items():
                    out.append((method, route.openapi_path, param.name, name, value))
    return out


PATH_CASES = _path_cases()


@pytest.mark.parametrize(
    ("method", "template", "param", "kind", "value"),
    PATH_CASES,
    ids=[f"{m} {t} {p}={k}" for m, t, p, k, _ in PATH_CASES],
)
def test_bad_path_ids_name_the_parameter(
    gateway: ThreadedGateway, seeded: dict[str, str], method: str, template: str, param: str, kind: str, value: bytes
) -> None:
    """Every path parameter of every route (streams included): a NUL (which PostgreSQL cannot
    store — it was a 500), other control characters, bytes that are not UTF-8, 4,000 characters:
    a 4xx naming the parameter, never a 5xx."""
    target = template.replace("{" + param + "}", value.decode()).encode()
    target = re.sub(rb"\{[a-z_]+\}", lambda m: seeded.get(m.group(0)[1:-1].decode(), "x").encode(), target)
    answer = send_raw(gateway.base_url, method, target, headers=_bearer(gateway.gateway.admin_token))
    if kind in ("non-utf-8", "overlong utf-8") and answer.status == 200:
        return  # an id nothing holds may be a valid question (`/v1/online/observations/{trace_id}`)
    assert 400 <= answer.status < 500, (answer.status, answer.body[:300])
    error = answer.error()
    if kind in ("non-utf-8", "overlong utf-8"):
        assert error.field, error  # a well-formed id: the route may first refuse its empty body or missing ticket
        return
    assert error.field == param, error
    if kind in ("nul", "control", "newline", "delete"):
        assert answer.status == 400 or param == "name", error  # an asset name is looked up in a fixed table


BODY_ROUTES = [(m, r.path) for r in ROUTES if r.request is not None and r.tag != "mcp" for m in r.methods]
"""Every route that reads a JSON body of the API's own (the MCP SDK answers its own protocol's errors)."""

_DEEP_ARRAY = b"[" * 2_000 + b"]" * 2_000  # under every route's body limit (the smallest is 4 KiB)
_DEEP_OBJECT = b'{"a":' * 650 + b"1" + b"}" * 650

BODIES: dict[str, tuple[bytes, str]] = {
    # name: (body, content type)
    "deeply nested array": (_DEEP_ARRAY, "application/json"),
    "deeply nested object": (_DEEP_OBJECT, "application/json"),
    "huge float in an unknown key": (b'{"zz": 1e400}', "application/json"),
    "huge integer in an unknown key": (b'{"zz": ' + b"9" * 400 + b"}", "application/json"),
    "broken surrogate in an unknown key": (b'{"zz": "\\ud800"}', "application/json"),
    "NUL escape in a key": (b'{"a\\u0000b": 1}', "application/json"),
    "duplicate keys": (b'{"zz": 1, "zz": 2}', "application/json"),
    "not UTF-8": (b'{"zz": "\xff\xfe"}', "application/json"),
    "a form": (b"a=1&b=2", "application/x-www-form-urlencoded"),
    "multipart": (
        b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--x--\r\n",
        "multipart/form-data; boundary=x",
    ),
    "plain text": (b"hello", "text/plain"),
    "no content type": (b"\x00\x01\x02", ""),
}


@pytest.mark.parametrize(("method", "template"), BODY_ROUTES, ids=[f"{m} {p}" for m, p in BODY_ROUTES])
@pytest.mark.parametrize("kind", list(BODIES))
def test_bad_bodies_name_the_field(
    gateway: ThreadedGateway, seeded: dict[str, str], method: str, template: str, kind: str
) -> None:
    """Every body-taking route with what a generator rarely makes: nesting 2,000 deep (it was a
    RecursionError: 500), numbers no JSON reader type holds and broken escapes inside keys the
    typed decoder skips (they were a 500), NUL in a key, duplicate keys, bytes that are not UTF-8,
    and wrong content types (the body is read as JSON whatever the header says): a 400 naming the
    field (`$` for the document, its path for a value)."""
    body, content_type = BODIES[kind]
    target = re.sub(r"\{([a-z_]+)\}", lambda m: seeded[m.group(1)], template).encode()
    headers = _bearer(gateway.gateway.admin_token)
    if content_type:
        headers[b"Content-Type"] = content_type.encode()
    answer = send_raw(gateway.base_url, method, target, headers=headers, body=body)
    assert 400 <= answer.status < 500, (answer.status, answer.body[:300])
    error = answer.error()
    assert error.field, error
    assert error.code in ("invalid", "invalid_json"), error


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/batches", {"policy": {"trials": "HUGE_FLOAT"}}, "$.policy.trials"),
        ("/v1/batches", {"policy": {"trials": "HUGE_INT"}}, "$.policy.trials"),
        ("/v1/batches", {"policy": {"retries": "HUGE_INT"}}, "$.policy.retries"),
        ("/v1/batches", {"harness": {"timeout_s": "HUGE_FLOAT"}}, "$.harness.timeout_s"),
        ("/ui/login", {"token": "HUGE_INT"}, "$.token"),
    ],
)
def test_huge_numbers_in_known_fields_name_them(
    gateway: ThreadedGateway, path: str, body: dict[str, Any], field: str
) -> None:
    doc: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(batch_spec(("c1",)))) if path == "/v1/batches" else {}
    for key, value in body.items():
        doc[key] = {**doc.get(key, {}), **value} if isinstance(value, dict) else value
    raw = msgspec.json.encode(doc).replace(b'"HUGE_FLOAT"', b"1e400").replace(b'"HUGE_INT"', b"9" * 400)
    headers = {**_bearer(gateway.gateway.admin_token), b"Content-Type": b"application/json"}
    answer = send_raw(gateway.base_url, "POST", path.encode(), headers=headers, body=raw)
    assert answer.status == 400, answer.body[:300]
    assert answer.error().field == field


def test_ids_with_control_characters_in_a_spec_are_refused(gateway: ThreadedGateway) -> None:
    """A NUL in a case id would be published and then refused by the event store (PostgreSQL
    cannot store it), so the batch could never finish: the spec is refused up front."""
    for where, path, value in (
        ("$.suite.id", ("suite", "id"), "s\u0000"),
        ("$.suite.cases[0].id", ("suite", "cases", 0, "id"), "c\u0000"),
        ("$.suite.cases[0].id", ("suite", "cases", 0, "id"), "c\n1"),
        ("$.harness.id", ("harness", "id"), "h\u0001"),
        ("$.supersede_key", ("supersede_key",), "k\u007f"),
    ):
        doc: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(batch_spec(("c1",))))
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        resp = requests.post(f"{gateway.base_url}/v1/batches", json=doc, headers=_auth(ALICE), timeout=30)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["field"] == where, resp.text


@pytest.mark.parametrize(
    ("name", "headers", "status", "field"),
    [
        ("token not UTF-8", {b"Authorization": b"Bearer \xff\xfe\xfd"}, 401, "Authorization"),
        ("scheme not UTF-8", {b"Authorization": b"\xff\xfe token"}, 401, "Authorization"),
        ("session cookie not UTF-8", {b"Cookie": b"evalbus_session=\xff\xfe"}, 401, "Authorization"),
        ("empty bearer", {b"Authorization": b"Bearer "}, 401, "Authorization"),
        ("basic scheme", {b"Authorization": b"Basic YWRtaW46YWRtaW4="}, 401, "Authorization"),
    ],
)
def test_bad_credentials_are_401_naming_the_header(
    gateway: ThreadedGateway, name: str, headers: dict[bytes, bytes], status: int, field: str
) -> None:
    """A credential that is not UTF-8 was a 500 (the token digest encoded it); now it is unknown."""
    answer = send_raw(gateway.base_url, "GET", b"/v1/me", headers=headers)
    assert answer.status == status, answer.body[:300]
    assert answer.error().field == field


SSE_ROUTES = [r for r in ROUTES if r.operation_id in STREAMING and r.tag != "mcp" and 101 not in r.responses]


@pytest.mark.parametrize("route", SSE_ROUTES, ids=[r.operation_id for r in SSE_ROUTES])
@pytest.mark.parametrize(
    "value",
    [b"abc", b"-4", b"1.5", b"99999999999999999999999999", b"\xd9\xa3", b"1_0", b"+1", b"0x10"],
    ids=["letters", "negative", "fraction", "beyond 64 bits", "arabic digit", "underscore", "plus", "hex"],
)
def test_event_streams_refuse_bad_resume_points(
    gateway: ThreadedGateway, seeded: dict[str, str], route: Route, value: bytes
) -> None:
    """The streams' only input besides the path: `Last-Event-ID` must be a decimal sequence that
    fits JetStream's 64 bits (beyond, the server would have refused the consumer)."""
    target = re.sub(r"\{([a-z_]+)\}", lambda m: seeded[m.group(1)], route.path).encode()
    headers = {**_bearer(gateway.gateway.admin_token), b"Last-Event-ID": value}
    answer = send_raw(gateway.base_url, "GET", target, headers=headers)
    assert answer.status == 400, answer.body[:300]
    assert answer.error().field == "Last-Event-ID"


def test_mcp_answers_bad_input_with_its_protocols_errors(gateway: ThreadedGateway) -> None:
    """`/mcp` speaks JSON-RPC: its SDK answers malformed messages with JSON-RPC errors (4xx, never
    5xx); a tool's bad argument reaches the API and comes back as the tool's error naming the
    field; a body over the API's limit is the API's 413 (it was read unbounded)."""
    headers = {
        **_bearer(gateway.gateway.admin_token),
        b"Content-Type": b"application/json",
        b"Accept": b"application/json, text/event-stream",
    }

    def call(body: bytes, **extra: bytes) -> Answer:
        return send_raw(
            gateway.base_url,
            "POST",
            b"/mcp",
            headers={**headers, **{k.encode(): v for k, v in extra.items()}},
            body=body,
        )

    for body in (b"not json", b"[" * 100_000, b"{}", b'{"jsonrpc": "2.0", "id": 1, "method": 7}'):
        answer = call(body)
        assert 400 <= answer.status < 500, (body[:20], answer.status, answer.body[:200])
    assert call(b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}', Accept=b"text/html").status == 406

    def tool(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
        answer = call(msgspec.json.encode(message))
        assert answer.status == 200, answer.body[:300]
        result: dict[str, Any] = msgspec.json.decode(answer.body)["result"]
        assert result["isError"] is True, result
        return result

    assert "(field batch_id)" in tool("get_batch", {"batch_id": "a\u0000b"})["content"][0]["text"]
    assert "(field run_id)" in tool("get_run", {"run_id": "r" * 300})["content"][0]["text"]
    assert "(field limit)" in tool("list_batches", {"limit": 10**6})["content"][0]["text"]
    tool("get_batch", {"batch_id": 7})  # the SDK's own argument validation
    answer = call(b" " * (LIMIT + 1))
    assert answer.status == 413, answer.body[:200]
    assert answer.error().field == "$"


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("request line over 8 KiB", b"/v1/batches/" + b"x" * 9000),
        ("raw bytes that are not UTF-8 in the path", b"/v1/batches/\xff\xfe"),
    ],
)
def test_requests_that_are_not_http_are_refused_by_the_parser(
    gateway: ThreadedGateway, name: str, target: bytes
) -> None:
    """What no route sees: aiohttp's HTTP parser refuses a request line it cannot read with its own
    plain-text 400 — never a 5xx, never a route's answer."""
    answer = send_raw(gateway.base_url, "GET", target, headers=_bearer(gateway.gateway.admin_token))
    assert answer.status == 400
    assert answer.content_type.startswith("text/plain")


def test_the_terminal_refuses_bad_input_before_any_shell(gateway: ThreadedGateway, seeded: dict[str, str]) -> None:
    """The WebSocket route takes a ticket, not a bearer token: without one 401 naming `ticket`; a
    size out of range 400 naming it; a plain GET 400 naming `Upgrade`; an upgrade with a ticket
    nobody minted 401 naming `ticket` (no socket is opened)."""
    path = f"/v1/runs/{seeded['run_id']}/terminal"
    upgrade = {
        b"Connection": b"Upgrade",
        b"Upgrade": b"websocket",
        b"Sec-WebSocket-Version": b"13",
        b"Sec-WebSocket-Key": b"dGhlIHNhbXBsZSBub25jZQ==",
    }
    for query, headers, status, field in (
        ("", upgrade, 401, "ticket"),
        ("?ticket=x&cols=0", upgrade, 400, "cols"),
        ("?ticket=x&rows=%00", upgrade, 400, "rows"),
        ("?ticket=x&cols=99999999999999999999", upgrade, 400, "cols"),
        ("?ticket=x", {}, 400, "Upgrade"),
        ("?ticket=" + "t" * 3000, upgrade, 401, "ticket"),
        ("?ticket=%FF%FE", upgrade, 401, "ticket"),
    ):
        answer = send_raw(gateway.base_url, "GET", (path + query).encode(), headers=headers)
        assert answer.status == status, (query, answer.status, answer.body[:300])
        assert answer.error().field == field, (query, answer.body[:300])
