"""Actions on a live sandbox end to end: the five services as real processes plus a second gateway
replica, alice's runs held running by a harness that waits for a file.

- exec: through either replica, in the sandbox's workdir and environment with secrets masked; the
  run's creator and an admin may, another member gets 404 (as for a missing run), no token 401, an unknown run 404; a
  command still running when the sandbox is released ends with it; a settled run is `found: false`;
  every command is marked in the sealed trajectory;
- terminal: a ticket minted on one replica opens a WebSocket on the other; keystrokes typed before
  the shell is attached arrive; the shell keeps its state across commands and follows resizes; a
  ticket works once and not after it expired; the socket closes with 4410 and a reason when the
  sandbox is released.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from evalbus.testing.pipeline import (
    GATEWAY_TOKEN_SECRET,
    REPO_ROOT,
    Pipeline,
    eventually,
    open_pipeline,
    wait_path,
)
from evalbus_api.actions import ExecView, TicketView
from evalbus_api.client import GatewayClient
from evalbus_contracts import BatchSpec, CaseExecuted, CaseSpec, CommandHarness, Infra, SuiteSpec, decode_event, utcnow
from evalbus_gateway.testing import RunningGateway, member, running_gateway

pytestmark = pytest.mark.e2e

AGENT = REPO_ROOT / "tests" / "harnesses" / "live_agent.py"
ALICE, BOB = "tok-alice-actions", "tok-bob-actions"


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    workdir = tmp_path_factory.mktemp("live-actions")
    tokens = workdir / "tokens.json"
    tokens.write_text(
        json.dumps({ALICE: {"principal": "alice", "role": "member"}, BOB: {"principal": "bob", "role": "member"}})
    )
    env = {"dispatcher": {"DISPATCHER_SLOTS": "2"}, "gateway": {"GATEWAY_TOKENS_FILE": str(tokens)}}
    async with open_pipeline(pg_admin_url, workdir, service_env=env) as p:
        yield p


@pytest.fixture(scope="module")
async def replica(pipeline: Pipeline) -> AsyncIterator[RunningGateway]:
    """A second gateway replica on the pipeline's bus and database, with 1 s terminal tickets."""
    async with running_gateway(
        pipeline.nats.url,
        pipeline.database_url,
        admin_token=pipeline.stack.admin_token,
        tokens={ALICE: member("alice"), BOB: member("bob")},
        terminal_ticket_s=1.0,
    ) as gateway:
        yield gateway


async def call(base: str, method: str, path: str, token: str | None, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http, http.request(method, base + path, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def running_case(pipeline: Pipeline, tmp_path: Path, name: str) -> tuple[str, str, Path]:
    """Alice's batch of one case held running until `go` exists: (batch id, run id, go)."""
    ready, go = tmp_path / f"{name}-ready", tmp_path / f"{name}-go"
    task = {"phases": [{"stdout": [f"{name} is running"], "ready": str(ready), "go": str(go)}], "answer": "done"}
    spec = BatchSpec(
        suite=SuiteSpec(id=name, cases=(CaseSpec(id="c1", input=msgspec.json.encode(task).decode()),)),
        harness=CommandHarness(
            id="live-agent",
            command=(sys.executable, str(AGENT)),
            timeout_s=120,
            env={"CASE_COLOUR": "teal"},
            secret_env={"GATEWAY_TOKEN": GATEWAY_TOKEN_SECRET},
        ),
    )
    async with GatewayClient(pipeline.stack.gateway_url, ALICE) as alice:
        batch_id = (await alice.submit(spec)).batch_id
    await wait_path(ready)
    return batch_id, f"evb-{batch_id}-c1", go


async def sealed_marks(pipeline: Pipeline, run_id: str) -> list[Infra]:
    trajectory = await pipeline.gw.trajectory(run_id)
    executed = [decode_event(bytes(e.body)) for e in trajectory.events if e.type == "case.executed"]
    assert len(executed) == 1
    assert isinstance(executed[0], CaseExecuted)
    return [e for e in executed[0].result.trace if isinstance(e, Infra)]


async def test_exec_in_a_live_sandbox(pipeline: Pipeline, replica: RunningGateway, tmp_path: Path) -> None:
    batch_id, run_id, go = await running_case(pipeline, tmp_path, "exec")
    stack, other = pipeline.stack.gateway_url, replica.base_url
    path = f"/v1/runs/{run_id}/exec"
    command = {"command": 'echo "colour=$CASE_COLOUR token=$GATEWAY_TOKEN"; ls; pwd >&2'}

    status, body = await call(other, "POST", path, ALICE, command)
    assert status == 200, body
    done = msgspec.convert(body, ExecView)
    assert (done.found, done.exit_code, done.run_id) == (True, 0, run_id)
    assert done.stdout.splitlines()[0] == "colour=teal token=[redacted]"
    assert pipeline.stack.admin_token not in done.stdout
    assert done.stderr.endswith("/work")  # the case's workdir

    assert (await call(stack, "POST", path, pipeline.stack.admin_token, {"command": "true"}))[0] == 200
    status, body = await call(stack, "POST", path, BOB, command)
    assert (status, body["error"]["code"]) == (404, "not_found")  # another member's: as if missing
    assert (await call(other, "POST", path, BOB, command))[0] == 404
    assert (await call(stack, "POST", path, None, command))[0] == 401
    assert (await call(stack, "POST", f"/v1/runs/evb-{batch_id}-nope/exec", ALICE, command))[0] == 404
    status, body = await call(stack, "POST", path, ALICE, {"command": "true", "timeout_s": 0})
    assert (status, body["error"]["field"]) == (400, "$.timeout_s")

    # A command still running when the run ends and its sandbox is released ends with it.
    started = tmp_path / "sleeping"
    # its timeout far beyond the release, so that only the release can end it (124 would be the timeout)
    cut_by_release = {"command": f"touch {started}; sleep 300", "timeout_s": 120}
    sleeper = asyncio.create_task(call(other, "POST", path, ALICE, cut_by_release))
    await wait_path(started)
    go.touch()
    status, body = await sleeper
    assert status == 200, body
    cut = msgspec.convert(body, ExecView)
    assert (cut.found, cut.exit_code) == (True, 137)
    assert cut.ended == "the run's sandbox was released while the command ran"

    await pipeline.finalized(batch_id)
    status, body = await call(stack, "POST", path, ALICE, {"command": "true"})
    assert (status, body["found"], body["exit_code"]) == (200, False, None)
    marks = [m.message for m in await sealed_marks(pipeline, run_id) if m.event == "exec"]
    assert (
        marks[0] == 'alice ran `echo "colour=$CASE_COLOUR token=$GATEWAY_TOKEN"; ls; pwd >&2` in the sandbox (exit 0)'
    )
    assert marks[1] == "admin ran `true` in the sandbox (exit 0)"
    assert marks[2].endswith("in the sandbox (the run's sandbox was released while the command ran)")


class Socket:
    """A terminal WebSocket: output collected, JSON notes and the close awaited."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.output = b""
        self.notes: list[dict[str, Any]] = []

    async def until(self, what: str, check: Any, timeout_s: float = 20.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not check():
                message = await self.ws.receive()
                if message.type == aiohttp.WSMsgType.BINARY:
                    self.output += message.data
                elif message.type == aiohttp.WSMsgType.TEXT:
                    self.notes.append(json.loads(message.data))
                elif message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                    if not check():
                        raise AssertionError(f"closed while waiting for {what}: {self.ws.close_code}")
                    return


async def open_socket(http: aiohttp.ClientSession, base: str, url: str) -> aiohttp.ClientWebSocketResponse:
    return await http.ws_connect(base.replace("http://", "ws://") + url)


async def test_an_interactive_terminal_across_replicas(
    pipeline: Pipeline, replica: RunningGateway, tmp_path: Path
) -> None:
    batch_id, run_id, go = await running_case(pipeline, tmp_path, "terminal")
    stack, other = pipeline.stack.gateway_url, replica.base_url
    path = f"/v1/runs/{run_id}/terminal-ticket"
    assert (await call(stack, "POST", path, BOB))[0] == 404
    assert (await call(stack, "POST", path, None))[0] == 401
    status, body = await call(stack, "POST", path, ALICE)
    assert status == 201, body
    ticket = msgspec.convert(body, TicketView)
    assert ticket.url == f"/v1/runs/{run_id}/terminal?ticket={ticket.ticket}"

    async with aiohttp.ClientSession() as http:
        ws = await open_socket(http, other, ticket.url + "&cols=90&rows=20")  # minted on one, spent on the other
        sock = Socket(ws)
        # Typed at once, before the shell is attached: kept and delivered in order.
        await ws.send_bytes(b"mkdir -p deep && cd deep && X=41\n")
        await ws.send_str(json.dumps({"type": "input", "data": 'echo "answer:$((X+1)):$(basename $PWD)"\n'}))
        await sock.until("the answer", lambda: b"answer:42:deep" in sock.output)
        assert sock.notes[0]["type"] == "attached"
        await ws.send_bytes(b"stty size\n")
        await sock.until("the first size", lambda: b"20 90" in sock.output)
        await ws.send_str(json.dumps({"type": "resize", "cols": 120, "rows": 33}))
        await ws.send_bytes(b"stty size; echo token=$GATEWAY_TOKEN\n")
        await sock.until("the new size", lambda: b"33 120" in sock.output and b"token=[redacted]" in sock.output)
        assert pipeline.stack.admin_token.encode() not in sock.output

        # The ticket worked once: spent, on any replica.
        for base in (stack, other):
            with pytest.raises(aiohttp.WSServerHandshakeError) as reused:
                await open_socket(http, base, ticket.url)
            assert reused.value.status == 401

        # A ticket minted on the replica (1 s there) no longer works once it expired.
        status, body = await call(other, "POST", path, ALICE)
        short = msgspec.convert(body, TicketView)
        await eventually(lambda: utcnow() > short.expires_at, timeout_s=5, what="the short ticket to expire")
        with pytest.raises(aiohttp.WSServerHandshakeError) as expired:
            await open_socket(http, stack, short.url)
        assert expired.value.status == 401

        # The run ends: its sandbox is released and the terminal closes, saying why.
        go.touch()
        await sock.until("the close", lambda: ws.closed)
        assert ws.close_code == 4410
        assert sock.notes[-1] == {"type": "closed", "reason": "the run's sandbox was released", "exit_code": None}

    await pipeline.finalized(batch_id)
    marks = [m.message for m in await sealed_marks(pipeline, run_id) if m.event == "terminal"]
    assert marks[0].startswith("alice opened a terminal in the sandbox")
    assert marks[-1] == "alice's terminal closed: the run's sandbox was released"
    # No live sandbox any more: a new ticket opens a socket that closes at once with 4404.
    status, body = await call(stack, "POST", path, ALICE)
    async with aiohttp.ClientSession() as http:
        ws = await open_socket(http, stack, msgspec.convert(body, TicketView).url)
        sock = Socket(ws)
        await sock.until("the close", lambda: ws.closed)
        assert ws.close_code == 4404
        assert sock.notes[-1]["reason"] == "no live sandbox holds the run"
