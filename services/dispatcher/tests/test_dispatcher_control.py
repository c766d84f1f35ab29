"""The live actions on a real local sandbox over a real nats-server, as a gateway reaches them: exec
(workdir, environment, secrets masked, timeout; a command the release ends; nobody answering once
the sandbox is gone), the interactive terminal (a persistent shell on a real pseudo-terminal, resize,
keystrokes sent right after attaching, secrets masked, the shell ending with the sandbox), and the
marks they leave in the run's trace."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from evalbus.testing.pipeline import eventually
from evalbus_contracts import CaseRequested, decode, encode, subjects
from evalbus_contracts.control import (
    CLOSE_RELEASED,
    ExecReply,
    ExecRequest,
    TermClosed,
    TerminalOpen,
    TerminalOpened,
    TerminalOut,
    TermInput,
    TermOutput,
    TermResize,
)
from evalbus_dispatcher import LocalBackend, LocalSandbox
from evalbus_dispatcher.backends.pty_shell import StreamRedactor
from evalbus_dispatcher.control import Detach, LiveControls, fit_reply
from evalbus_runtime import connect

from .conftest import SECRET_VALUE

pytestmark = pytest.mark.integration

MakeRequest = Callable[..., CaseRequested]


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    client = await connect(nats_url, "dispatcher-control-test")
    yield client
    await client.close()


class Live:
    """A provisioned sandbox whose live actions answer on the bus, and the marks they leave."""

    def __init__(self, run_id: str, sandbox: LocalSandbox, detach: Detach, marks: list[tuple[str, str]]) -> None:
        self.run_id = run_id
        self.sandbox = sandbox
        self.detach = detach
        self.marks = marks

    async def release(self) -> None:
        await self.detach()
        await self.sandbox.release()


@pytest.fixture
async def live(nc: NatsClient, backend: LocalBackend, make_request: MakeRequest, tmp_path: Path) -> AsyncIterator[Live]:
    req = make_request(("true",), env={"CASE_COLOUR": "teal"}, secret_env={"API_KEY": "api-key"})
    req = msgspec.structs.replace(req, run_id=f"evb-ctl-{uuid.uuid4().hex[:8]}")
    sandbox = await backend.provision(req)
    (sandbox.workdir / "notes.txt").write_text("hello from the workdir\n")
    marks: list[tuple[str, str]] = []

    async def mark(event: str, message: str) -> None:
        marks.append((event, message))

    controls = LiveControls(nc, ping_s=0.2)
    detach = await controls.attach(req.run_id or "", sandbox, mark)
    handle = Live(req.run_id or "", sandbox, detach, marks)
    yield handle
    await handle.release()


async def exec_in(nc: NatsClient, run_id: str, command: str, timeout_s: float = 10.0) -> ExecReply:
    reply = await nc.request(
        subjects.control_subject(run_id, "exec"),
        encode(ExecRequest(command=command, timeout_s=timeout_s, principal="alice")),
        timeout=timeout_s + 5,
    )
    return decode(reply.data, ExecReply)


async def test_exec_runs_in_the_workdir_and_environment_with_secrets_masked(live: Live, nc: NatsClient) -> None:
    done = await exec_in(nc, live.run_id, "cat notes.txt; echo colour=$CASE_COLOUR key=$API_KEY; echo oops >&2; exit 3")
    assert done.found
    assert done.stdout == "hello from the workdir\ncolour=teal key=[redacted]"
    assert SECRET_VALUE not in done.stdout
    assert (done.stderr, done.exit_code, done.timed_out, done.ended) == ("oops", 3, False, None)
    assert live.marks == [
        (
            "exec",
            "alice ran `cat notes.txt; echo colour=$CASE_COLOUR key=$API_KEY; echo oops >&2; exit 3` in the sandbox (exit 3)",
        )
    ]  # noqa: E501


async def test_a_command_exec_cannot_carry_is_answered_not_dropped(live: Live, nc: NatsClient) -> None:
    """A NUL byte makes exec(2) raise ValueError: the dispatcher still answers (else the gateway
    waits out its timeout and tells the user to retry what can never work)."""
    done = await exec_in(nc, live.run_id, "echo a\x00b")
    assert (done.found, done.exit_code) == (True, 127)
    assert "cannot run the command" in done.stderr
    assert "null byte" in done.stderr


async def test_exec_times_out_with_124(live: Live, nc: NatsClient) -> None:
    done = await exec_in(nc, live.run_id, "echo started; sleep 30", timeout_s=0.5)
    assert (done.found, done.exit_code, done.timed_out, done.stdout) == (True, 124, True, "started")


async def test_a_command_running_when_the_sandbox_is_released_ends_with_it(live: Live, nc: NatsClient) -> None:
    ready = live.sandbox.workdir / "ready"
    # a timeout far beyond the release: only the release may end it (a 124 is the timeout's doing)
    pending = asyncio.create_task(exec_in(nc, live.run_id, f"touch {ready}; sleep 300", timeout_s=120))
    await eventually(ready.exists, timeout_s=30, what="the command to start")
    await live.release()
    done = await pending
    assert done.found
    assert done.ended == "the run's sandbox was released while the command ran"
    assert done.exit_code == 137
    # Once released, nobody answers for the run.
    with pytest.raises(nats.errors.NoRespondersError):
        await exec_in(nc, live.run_id, "true")


class Terminal:
    """A terminal session as the gateway drives it: output collected, the end awaited."""

    def __init__(self, nc: NatsClient, run_id: str) -> None:
        self.nc = nc
        self.run_id = run_id
        self.session = uuid.uuid4().hex
        self.output = b""
        self.closed: TermClosed | None = None
        self.changed = asyncio.Event()

    async def on_out(self, msg: Msg) -> None:
        frame = msgspec.json.decode(msg.data, type=TerminalOut)
        if isinstance(frame, TermOutput):
            self.output += frame.data
        elif isinstance(frame, TermClosed):
            self.closed = frame
        self.changed.set()

    async def open(self, cols: int = 80, rows: int = 24) -> TerminalOpened:
        await self.nc.subscribe(subjects.terminal_subject(self.session, "out"), cb=self.on_out)
        reply = await self.nc.request(
            subjects.control_subject(self.run_id, "terminal"),
            encode(TerminalOpen(session=self.session, cols=cols, rows=rows, principal="alice")),
            timeout=10,
        )
        return decode(reply.data, TerminalOpened)

    async def send(self, frame: TermInput | TermResize) -> None:
        await self.nc.publish(subjects.terminal_subject(self.session, "in"), encode(frame))

    async def type(self, text: str) -> None:
        await self.send(TermInput(data=text.encode()))

    async def until(self, check: Callable[[], bool], timeout_s: float = 15.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not check():
                self.changed.clear()
                await self.changed.wait()


async def test_a_persistent_shell_on_a_real_terminal(live: Live, nc: NatsClient) -> None:
    term = Terminal(nc, live.run_id)
    opened = await term.open(cols=100, rows=30)
    assert opened.found
    # Typed at once after attaching: nothing is lost.
    await term.type("mkdir -p deeper && cd deeper && SESSION=alive\n")
    await term.type('echo "state:$SESSION:$(basename $PWD)"\n')
    await term.until(lambda: b"state:alive:deeper" in term.output)
    await term.type("stty size; tty\n")
    await term.until(lambda: b"30 100" in term.output and b"/dev/pts/" in term.output)
    await term.send(TermResize(cols=132, rows=43))
    await term.type("stty size\n")
    await term.until(lambda: b"43 132" in term.output)
    await term.type("echo key=$API_KEY\n")
    await term.until(lambda: b"key=[redacted]" in term.output)
    assert SECRET_VALUE.encode() not in term.output
    assert [event for event, _ in live.marks] == ["terminal"]

    await live.release()
    await term.until(lambda: term.closed is not None)
    assert term.closed == TermClosed(reason="the run's sandbox was released", code=CLOSE_RELEASED)
    assert [m for _, m in live.marks][-1] == "alice's terminal closed: the run's sandbox was released"


async def test_a_shell_that_exits_says_so(live: Live, nc: NatsClient) -> None:
    term = Terminal(nc, live.run_id)
    assert (await term.open()).found
    await term.type("exit 7\n")
    await term.until(lambda: term.closed is not None)
    assert term.closed == TermClosed(reason="the shell exited with 7", exit_code=7)


async def test_a_silent_client_loses_its_shell(live: Live, nc: NatsClient) -> None:
    term = Terminal(nc, live.run_id)
    assert (await term.open()).found
    await term.until(lambda: term.closed is not None)  # no keep-alive for three pings (0.6 s)
    assert term.closed is not None
    assert term.closed.reason == "the client went silent"


@pytest.mark.unit
def test_secrets_split_across_chunks_are_still_masked() -> None:
    redactor = StreamRedactor(["s3cret-value"])
    out = redactor.feed(b"key=s3c") + redactor.feed(b"ret-va") + redactor.feed(b"lue done\n")
    assert out + redactor.flush() == b"key=[redacted] done\n"
    assert redactor.feed(b"plain text") == b"plain text"  # nothing held without a possible start
    assert redactor.feed(b"ends with s3") == b"ends with "
    assert redactor.flush() == b"s3"  # a prefix alone is not the secret


@pytest.mark.unit
def test_an_oversized_reply_is_cut_to_fit_one_message() -> None:
    big = ExecReply(found=True, stdout="\x01" * 200_000, stderr="e" * 10, exit_code=0)
    data = fit_reply(big)
    assert len(data) <= 900 * 1024
    cut = decode(data, ExecReply)
    assert cut.truncated
    assert cut.exit_code == 0
