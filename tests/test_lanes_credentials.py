"""A lane credential on a real nats-server with accounts: `evalbus up --secure` (nats-server and
the database only), then `evalbus lane credential gpu` adds the lane's user to the running server
(a reload, nothing restarted). A real dispatcher started with the environment it printed — as a
GPU box or a laptop joining over the bus would — takes the lane's case and runs it with that user
only (the server reports no permission violation), honours a cancellation, and leaves the default
lane's case alone; the
gateway's own user reads the lane's queue for a run's placement; the
same user is refused by the server another lane's queue, its own consumer with a wider filter, a
batch, a stream's definition, and other clients' inboxes. The user outlives `evalbus down` / `up`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import stat
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from tests.test_cli_up import Stack, explain, stack  # noqa: F401 - the fixture

from evalbus.infra.endpoints import url_as
from evalbus.testing.pipeline import eventually
from evalbus_contracts import (
    STREAMS,
    BatchCancelled,
    CaseExecuted,
    CasePlan,
    CaseRequested,
    CaseSpec,
    CommandHarness,
    decode_event,
    encode,
    lane_consumer,
    subjects,
)
from evalbus_dispatcher.service import DispatcherSettings, build_dispatcher
from evalbus_gateway.live.dispatchers import latest_request, requests_ahead
from evalbus_runtime import Service, ensure_topology, load_settings

pytestmark = [pytest.mark.e2e]


def credential(on: Stack, lane: str) -> dict[str, str]:
    done = on.run("lane", "credential", lane)
    assert done.returncode == 0, explain(done)
    env: dict[str, str] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        env[key] = shlex.split(value)[0]
    return env


def request(lane: str, case_id: str, batch_id: str) -> CaseRequested:
    return CaseRequested(
        batch_id=batch_id,
        case_id=case_id,
        run_id=f"evb-{batch_id}-{case_id}",
        case=CaseSpec(id=case_id, input="hello"),
        harness=CommandHarness(id="cat", command=("cat",), lane=lane),
        plan=CasePlan(retries=0),
    )


@contextlib.asynccontextmanager
async def running(service: Service) -> AsyncIterator[Service]:
    await asyncio.wait_for(service.start(), 30)
    try:
        yield service
    finally:
        await service.stop()


async def refusal(url: str, inbox_prefix: str, action: str) -> str:
    """What the server answers the user of `url` trying `action` (`publish:<subject>` or
    `subscribe:<subject>`): its permission violation, or "" when it said nothing."""
    errors: list[str] = []
    seen = asyncio.Event()

    async def on_error(e: Exception) -> None:
        errors.append(str(e).lower())
        seen.set()

    nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False, inbox_prefix=inbox_prefix)
    try:
        kind, subject = action.split(":", 1)
        if kind == "publish":
            await nc.publish(subject, b"{}")
        else:
            await nc.subscribe(subject)
        await nc.flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(seen.wait(), 5)  # the violation comes back on the connection
    finally:
        await nc.close()
    return " | ".join(errors)


async def executed(js: nats.js.JetStreamContext, req: CaseRequested) -> CaseExecuted | None:
    subject = subjects.case_subject(subjects.CASE_EXECUTED, req.batch_id or "", req.case_id or "")
    try:
        raw = await js.get_last_msg("CASES", subject)
    except nats.js.errors.NotFoundError:
        return None
    event = decode_event(raw.data or b"")
    assert isinstance(event, CaseExecuted)
    return event


async def test_a_lane_credential_takes_its_lanes_cases_and_nothing_else(
    stack: Stack,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    done = await asyncio.to_thread(stack.up, "--secure", "--no-services")
    assert done.returncode == 0, explain(done)
    refused_before = await asyncio.to_thread(stack.run, "lane", "credential", "Big-GPU")
    assert refused_before.returncode == 2
    assert "not a lane name" in refused_before.stderr

    env = await asyncio.to_thread(credential, stack, "gpu")
    assert set(env) == {
        "NATS_URL",
        "DISPATCHER_LANES",
        "DISPATCHER_INBOX_PREFIX",
        "DISPATCHER_CREATE_TOPOLOGY",
        "DISPATCHER_CANCELLATIONS",
    }
    assert (env["DISPATCHER_LANES"], env["DISPATCHER_INBOX_PREFIX"]) == ("gpu", "_INBOX.lane-gpu")
    assert env["NATS_URL"].startswith("nats://lane-gpu:")
    assert await asyncio.to_thread(credential, stack, "gpu") == env  # asked again: the same user
    users_file = stack.dir / "nats" / "users.json"
    for private in (users_file, stack.dir / "nats" / "accounts.conf"):
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o600, private
    passwords = json.loads(users_file.read_text())
    nats_url = json.loads((stack.dir / "endpoints.json").read_text())["nats"]

    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    admin = await nats.connect(url_as(nats_url, "admin", passwords["admin"]))
    try:
        ajs = admin.jetstream()
        await ensure_topology(ajs, STREAMS, ())  # what the stack's services create at start
        (tmp_path / "work").mkdir()
        settings = load_settings(
            DispatcherSettings,
            "dispatcher",
            {**env, "DISPATCHER_SLOTS": "1", "DISPATCHER_WORKDIR_ROOT": str(tmp_path / "work"), "HTTP_PORT": "0"},
        )
        assert not settings.fans_out()
        service = Service(settings)
        build_dispatcher(service, settings)
        batch = f"b{uuid.uuid4().hex[:8]}"
        gpu, plain = request("gpu", "g1", batch), request("default", "c1", batch)
        stopped = f"b{uuid.uuid4().hex[:8]}"
        late = request("gpu", "g1", stopped)  # its batch is cancelled before it arrives
        cancel = BatchCancelled(batch_id=stopped, reason="cancelled", by="alice")
        await ajs.publish(cancel.subject(), encode(cancel), headers={"Nats-Msg-Id": cancel.msg_id()})
        async with running(service):
            for req in (plain, gpu, late):
                await ajs.publish(req.subject(), encode(req), headers={"Nats-Msg-Id": req.msg_id()})

            async def ran() -> bool:
                return await executed(ajs, gpu) is not None and await executed(ajs, late) is not None

            await eventually(ran, timeout_s=60, what="the lane dispatcher to execute the gpu cases")
            info = await ajs.consumer_info("CASES", lane_consumer("gpu").durable)
            assert info.config.filter_subject == "case.requested.*.*.gpu"
            assert await executed(ajs, plain) is None  # the default lane's case is not its to take
        done_gpu, done_late = await executed(ajs, gpu), await executed(ajs, late)
        assert done_gpu is not None
        assert (done_gpu.status, done_gpu.result.answer) == ("succeeded", "hello"), done_gpu.result.failure
        assert done_late is not None
        assert done_late.status == "cancelled"  # read per batch: its user may not follow them all

        # The gateway's own user reads a lane's queue for a run's placement.
        waiting = request("gpu", "g2", batch)
        ack = await ajs.publish(waiting.subject(), encode(waiting), headers={"Nats-Msg-Id": waiting.msg_id()})
        gateway = await nats.connect(url_as(nats_url, "gateway", passwords["gateway"]), error_cb=on_error)
        try:
            gjs = gateway.jetstream()
            stored = await latest_request(gjs, batch, "g2", waiting.run_id or "")
            assert stored is not None
            assert (stored.seq, stored.request.lane) == (ack.seq, "gpu")
            assert await requests_ahead(gjs, ack.seq, "gpu") == 0
            assert await requests_ahead(gjs, ack.seq, "nomad-eu") == 0  # a lane no dispatcher ever served
        finally:
            await gateway.close()
    finally:
        await admin.close()
    violations = [r.getMessage() for r in caplog.records if "permissions violation" in r.getMessage().lower()]
    assert (violations, errors) == ([], [])

    url, inbox = env["NATS_URL"], env["DISPATCHER_INBOX_PREFIX"]
    for action in (
        "publish:$JS.API.CONSUMER.MSG.NEXT.CASES.dispatcher-cases",
        "publish:$JS.API.CONSUMER.CREATE.CASES",  # through it a durable consumer is updated by name
        "publish:$JS.API.CONSUMER.MSG.NEXT.CASES.dispatcher-cases-nomad-eu",
        "publish:$JS.API.CONSUMER.DURABLE.CREATE.CASES.dispatcher-cases-gpu",
        "publish:$JS.API.CONSUMER.CREATE.CASES.dispatcher-cases-gpu.case.requested.>",
        "publish:$JS.API.CONSUMER.CREATE.CASES.dispatcher-cases.case.requested.*.*",
        "publish:$JS.API.STREAM.UPDATE.CASES",
        "publish:$JS.API.STREAM.DELETE.CASES",
        "publish:batch.requested.b1",
        "publish:case.requested.b1.c1",
        "publish:case.requested.b1.c1.nomad-eu",
        "publish:case.judged.b1.c1",
        "subscribe:case.requested.>",
        "subscribe:_INBOX.>",
    ):
        answer = await refusal(url, inbox, action)
        assert "permissions violation" in answer, (action, answer)
    assert await refusal(url, inbox, "publish:case.requested.b1.c1.gpu") == ""  # a retry of its own lane's case

    # The stack brought down and up again keeps the lane's user (and its password).
    for args in (("down", "--timeout", "5"), ("up", "--database", stack.database, "--secure", "--no-services")):
        done = await asyncio.to_thread(stack.run, *args)
        assert done.returncode == 0, explain(done)
    assert await asyncio.to_thread(credential, stack, "gpu") == env
    assert await refusal(url, inbox, "publish:case.requested.b1.c1.gpu") == ""
    assert "permissions violation" in await refusal(url, inbox, "publish:batch.requested.b1")
