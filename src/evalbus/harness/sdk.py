"""The Python harness SDK: a function `solve(case, ctx)` served as a warm worker harness.

`@harness` marks the function; `serve` speaks the worker protocol (`evalbus_contracts.
worker_protocol`) on this process's stdin and stdout: one case at a time, each in its own workdir
(the current directory while it runs) with its own `EVALBUS_*` variables, trace events through
`ctx`, the answer as the function's return value. What the function prints goes to the run's live
log; an exception fails that case only (`harness_error`, the traceback on stderr) and the worker
takes the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import importlib.util
import inspect
import io
import os
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, TypeAlias, overload

import msgspec

from evalbus_contracts import LlmCall, Log, Message, ToolCall, ToolResult, TraceEvent
from evalbus_contracts.worker_protocol import (
    CaseMessage,
    CdpMessage,
    DisplayMessage,
    EventMessage,
    LogMessage,
    Ready,
    ResultMessage,
)


@dataclass(frozen=True, slots=True)
class Answer:
    """What a harness function may return instead of a plain string."""

    text: str
    """The final answer."""


@dataclass(frozen=True, slots=True)
class Case:
    """The case a harness function is asked to solve."""

    id: str
    """The case id."""
    input: str
    """The task (JSON text when the suite gave a mapping or a list: see `json()`)."""
    run_id: str
    """The run id (`EVALBUS_RUN_ID`)."""
    batch_id: str | None = None
    """The batch, for batch runs."""
    trial: int = 1
    """The trial, from 1."""
    attempt: int = 1
    """The attempt, from 1."""

    def json(self) -> Any:
        """The input decoded as JSON (for a suite whose inputs are mappings or lists)."""
        return msgspec.json.decode(self.input)


Result: TypeAlias = str | Answer
SyncSolve: TypeAlias = Callable[[Case, "Context"], Result]
AsyncSolve: TypeAlias = Callable[[Case, "Context"], Awaitable[Result]]
Solve: TypeAlias = SyncSolve | AsyncSolve


class Context:
    """What a harness function reports through while it solves one case: trace events (timed
    from the moment the case was handed over) and its run's ids and workdir."""

    def __init__(self, case: CaseMessage, channel: _Channel) -> None:
        self._case = case
        self._channel = channel
        self._t0 = time.monotonic()
        self.run_id: str = case.run_id
        """The run id, the key of the run's trace, live views and trajectory."""
        self.case_id: str = case.case_id
        """The case id."""
        self.workdir: Path = Path(case.workdir)
        """The case's own workdir (also the current directory while the case runs); the sandbox
        graders run in it after the function returns."""

    def t(self) -> float:
        """Seconds since the case was handed over."""
        return time.monotonic() - self._t0

    def event(self, event: TraceEvent) -> None:
        """Report any trace event (its `t` is set to now when left at 0)."""
        if event.t == 0.0:
            event = msgspec.structs.replace(event, t=self.t())
        self._channel.send(EventMessage(run_id=self.run_id, event=msgspec.Raw(_encoder.encode(event))))

    def message(self, role: Literal["user", "assistant", "system"], text: str) -> None:
        """A conversation message (the last assistant message is the answer when none is returned)."""
        self.event(Message(role=role, text=text, t=self.t()))

    def llm_call(
        self,
        model: str,
        *,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cost_usd: float | None = None,
        latency_ms: float | None = None,
    ) -> None:
        """One model call, with what it cost when known."""
        self.event(
            LlmCall(
                model=model,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                cost_usd=cost_usd,
                latency_ms=latency_ms,
                duration_ms=latency_ms,
                t=self.t(),
            )
        )

    def tool_call(self, name: str, args: Mapping[str, Any] | None = None, *, id: str | None = None) -> str:
        """The agent asked for a tool; returns the call id to give `tool_result`."""
        call_id = id or uuid.uuid4().hex[:12]
        self.event(ToolCall(id=call_id, name=name, args=dict(args or {}), t=self.t()))
        return call_id

    def tool_result(self, call_id: str, output: str = "", *, ok: bool = True) -> None:
        """A tool answered the call `call_id`."""
        self.event(ToolResult(id=call_id, output=output, ok=ok, t=self.t()))

    def log(self, text: str, stream: Literal["stdout", "stderr"] = "stdout") -> None:
        """A `log` trace event (kept in the sealed trace, unlike what is printed)."""
        self.event(Log(stream=stream, text=text, t=self.t()))

    def cdp(self, url: str) -> None:
        """Declare the DevTools endpoint of the browser this case drives (the run's live screen)."""
        self._channel.send(CdpMessage(run_id=self.run_id, url=url))

    def display(self, name: str) -> None:
        """Declare the X display this case works on (`:99`; the run's live screen of a desktop case)."""
        self._channel.send(DisplayMessage(run_id=self.run_id, display=name))


_encoder = msgspec.json.Encoder()


class _Channel:
    """The protocol's output: one JSON object per line, flushed at once."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out

    def send(self, message: Ready | EventMessage | LogMessage | CdpMessage | DisplayMessage | ResultMessage) -> None:
        self._out.write(_encoder.encode(message) + b"\n")
        self._out.flush()


class _PrintedText(io.TextIOBase):
    """`sys.stdout` (or `sys.stderr`) while a case runs: each line printed becomes a `log` message
    of that case, in order with its events and result; between cases it goes to the real stderr."""

    def __init__(self, channel: _Channel, stream: Literal["stdout", "stderr"], between: IO[str]) -> None:
        self._channel = channel
        self._stream: Literal["stdout", "stderr"] = stream
        self._between = between
        self._pending = ""
        self.run_id: str | None = None

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            complete, _, self._pending = self._pending.rpartition("\n")
            self._emit(complete)
        return len(text)

    def flush(self) -> None:
        if self._pending:
            text, self._pending = self._pending, ""
            self._emit(text)

    def _emit(self, text: str) -> None:
        if self.run_id is None:
            self._between.write(text + "\n")  # printed between cases: not part of any run
            self._between.flush()
        else:
            self._channel.send(LogMessage(run_id=self.run_id, stream=self._stream, text=text))


@dataclass
class Harness:
    """A harness function, as `@harness` returns it: still callable as the function, and
    servable as a worker (`serve()`, or `python -m evalbus.harness module:function`)."""

    solve: Solve
    """The function."""
    name: str = field(default="")
    """Its qualified name."""

    def __call__(self, case: Case, ctx: Context) -> Result | Awaitable[Result]:
        return self.solve(case, ctx)

    def serve(self, stdin: IO[bytes] | None = None, stdout: IO[bytes] | None = None) -> int:
        """Serve the worker protocol until stdin ends; the exit code."""
        return serve(self, stdin=stdin, stdout=stdout)


@overload
def harness(solve: SyncSolve) -> Harness: ...
@overload
def harness(solve: AsyncSolve) -> Harness: ...
def harness(solve: Solve) -> Harness:
    """Mark `solve(case, ctx) -> str | Answer` (sync or async) as a harness function."""
    found = Harness(solve=solve, name=getattr(solve, "__qualname__", repr(solve)))
    functools.update_wrapper(found, solve)
    return found


def load_target(target: str) -> Harness:
    """The harness named `module:function` or `/path/to/file.py:function`; `ValueError` saying why
    it cannot be found (`TypeError` when it is not a function)."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"{target!r}: expected module:function or /path/to/file.py:function")
    if where.endswith(".py"):
        path = Path(where).resolve()
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None or not path.is_file():
            raise ValueError(f"{target!r}: no Python file at {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, module)
        sys.path.insert(0, str(path.parent))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    found = getattr(module, name, None)
    if found is None:
        raise ValueError(f"{target!r}: {where} has no attribute {name!r}")
    if isinstance(found, Harness):
        return found
    if not callable(found):
        raise TypeError(f"{target!r}: {name} is not a function")
    return harness(found)


@contextlib.contextmanager
def _in_case(case: CaseMessage, printed: tuple[_PrintedText, ...]) -> Iterator[None]:
    """The case's workdir as the current directory and its variables in the environment, for its
    duration."""
    home = os.getcwd()
    saved = {key: os.environ.get(key) for key in case.env}
    if case.batch_id is None:
        saved.setdefault("EVALBUS_BATCH_ID", os.environ.get("EVALBUS_BATCH_ID"))
        os.environ.pop("EVALBUS_BATCH_ID", None)
    os.environ.update(case.env)
    os.chdir(case.workdir)
    for stream in printed:
        stream.run_id = case.run_id
    try:
        yield
    finally:
        for stream in printed:
            stream.flush()
            stream.run_id = None
        os.chdir(home)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _answer_text(result: object) -> str | None:
    """The answer of a returned value (None: none given, the dispatcher falls back as for a command
    without a result line)."""
    if isinstance(result, Answer):
        return result.text
    if isinstance(result, str) or result is None:
        return result
    return str(result)


_case_decoder = msgspec.json.Decoder(CaseMessage)


def serve(target: Harness | Solve, *, stdin: IO[bytes] | None = None, stdout: IO[bytes] | None = None) -> int:
    """Serve `target` over the worker protocol until stdin ends (exit code 0), one case at a time.

    The protocol owns this process's stdout: anything else that writes to file descriptor 1 (a C
    extension, a child process) is sent to stderr instead, and while a case runs `sys.stdout` and
    `sys.stderr` are its log (sent in order with its events and its result).
    An async function runs on one event loop kept for the worker's life.
    """
    found = target if isinstance(target, Harness) else harness(target)
    if stdout is None:
        sys.stdout.flush()
        out: IO[bytes] = os.fdopen(os.dup(1), "wb")
        os.dup2(2, 1)
    else:
        out = stdout
    source = stdin if stdin is not None else sys.stdin.buffer
    channel = _Channel(out)
    real_stderr = sys.stderr
    printed = (_PrintedText(channel, "stdout", real_stderr), _PrintedText(channel, "stderr", real_stderr))
    sys.stdout, sys.stderr = printed
    loop: asyncio.AbstractEventLoop | None = None
    channel.send(Ready())
    try:
        for raw in source:
            if not raw.strip():
                continue
            case = _case_decoder.decode(raw)
            subject = Case(
                id=case.case_id,
                input=case.input,
                run_id=case.run_id,
                batch_id=case.batch_id,
                trial=case.trial,
                attempt=case.attempt,
            )
            ctx = Context(case, channel)
            with _in_case(case, printed):
                try:
                    result = found.solve(subject, ctx)
                    if inspect.isawaitable(result):
                        loop = loop or asyncio.new_event_loop()
                        result = loop.run_until_complete(result)
                except Exception as e:
                    sys.stderr.write(traceback.format_exc())  # the case's stderr, before its result
                    outcome = ResultMessage(run_id=case.run_id, error=f"{type(e).__name__}: {e}")
                else:
                    outcome = ResultMessage(run_id=case.run_id, answer=_answer_text(result))
            channel.send(outcome)
    finally:
        if loop is not None:
            loop.close()
    return 0
