"""Following a batch to its end and reading its scorecard: what `evalbus run` and `evalbus rejudge`
do after submitting.

The event stream's `end` comes from the stream itself, which can be a moment ahead of the read
models the API answers from, so `settled_view` waits (with a deadline) until the batch's read
model is finalized too, and falls back to the stream's `batch.finalized` when it is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import msgspec

from evalbus.cli.connection import GatewayTarget, TargetError, gateway_target
from evalbus.cli.progress import BatchProgress, ProgressDisplay
from evalbus.cli.scorecard import json_line, render_scorecard
from evalbus_api.client import ApiRequestError, GatewayClient
from evalbus_api.views import BatchView, RunView

SETTLE_TIMEOUT_S = 30.0
"""How long the read model may lag the stream's `end` before the stream's own summary is used."""

EXIT_FINALIZED = 0
"""The batch finalized `succeeded` (whatever its verdicts)."""
EXIT_NOT_SUCCEEDED = 1
"""The batch failed or was cancelled or superseded; or the gateway could not be used."""
EXIT_BAD_INPUT = 2
"""The suite, the judges or the request was invalid."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """A followed batch at its end."""

    view: BatchView
    """The batch as the API reports it (finalized)."""
    runs: list[RunView]
    """Every run of it."""
    progress: BatchProgress
    """What its event stream said."""

    @property
    def exit_code(self) -> int:
        """0 when it succeeded, 1 otherwise."""
        return EXIT_FINALIZED if self.view.status == "succeeded" else EXIT_NOT_SUCCEEDED


async def watch(client: GatewayClient, progress: BatchProgress, display: ProgressDisplay | None) -> None:
    """Fold the batch's event stream into `progress` (drawing it) until the stream's `end`; a timer
    draws what arrived between two events and notes a stall."""
    ticker = asyncio.create_task(_tick(display, progress)) if display is not None else None
    try:
        async for sse in client.events(progress.batch_id):
            progress.apply_sse(sse)
            if display is not None:
                display.update(progress)
    finally:
        if ticker is not None:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
    if display is not None:
        display.finish(progress)


async def _tick(display: ProgressDisplay, progress: BatchProgress) -> None:
    while True:
        await asyncio.sleep(display.tick_s)
        display.tick(progress)


async def settled_view(
    client: GatewayClient,
    progress: BatchProgress,
    *,
    timeout_s: float = SETTLE_TIMEOUT_S,
    clock: Callable[[], float] = time.monotonic,
) -> BatchView:
    """The batch from the API once its read model is finalized; after `timeout_s`, the API's view
    completed with the stream's `batch.finalized`."""
    deadline = clock() + timeout_s
    delay = 0.05
    while True:
        view = await client.get(progress.batch_id)
        if view.finalized_at is not None:
            return view
        if clock() > deadline:
            final = progress.finalized
            if final is None:
                return view
            return msgspec.structs.replace(
                view, status=final.status, summary=final.summary, export=final.export, error=final.error
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


async def follow(client: GatewayClient, progress: BatchProgress, display: ProgressDisplay | None) -> Outcome:
    """Watch the batch to its end, then read its view and runs."""
    await watch(client, progress, display)
    view = await settled_view(client, progress)
    runs = await client.all_cases(progress.batch_id)
    return Outcome(view=view, runs=runs, progress=progress)


def progress_display(json_output: bool) -> ProgressDisplay | None:
    """Bars on stdout (in place on a terminal); with `--json`, on stderr only when it is a terminal,
    so stdout carries nothing but the JSON line."""
    if json_output:
        return ProgressDisplay(sys.stderr, tty=True) if sys.stderr.isatty() else None
    return ProgressDisplay(sys.stdout, tty=sys.stdout.isatty())


def print_outcome(outcome: Outcome, *, json_output: bool, out: TextIO, **extra: str) -> None:
    """The scorecard, or the one JSON line."""
    view = outcome.view
    if json_output:
        out.write(json.dumps(json_line(view.batch_id, view.status, view.summary, **extra)) + "\n")
    else:
        out.write("\n" + render_scorecard(view, outcome.runs, outcome.progress.expected) + "\n")
    out.flush()


def api_failure(e: ApiRequestError, what: str) -> tuple[int, str]:
    """Exit code and message for an API error: bad input is 2, anything else 1."""
    if e.status == 0:
        return EXIT_NOT_SUCCEEDED, f"{what}: the gateway is unreachable ({e.message}); is evalbus up? (evalbus status)"
    field = f" at {e.field}" if e.field else ""
    code = EXIT_BAD_INPUT if e.status in (400, 413, 422) else EXIT_NOT_SUCCEEDED
    return code, f"{what}: {e.status} {e.code}{field}: {e.message}"


def error_line(line: str) -> None:
    """One line to stderr, flushed (progress may be drawing on stdout)."""
    print(line, file=sys.stderr, flush=True)


MAX_PROBLEMS_SHOWN = 20
"""Problems printed for one file; a dataset broken on every row would otherwise fill the screen."""


def report_spec_problems(command: str, what: str, source: str, problems: list[tuple[str, str]]) -> None:
    """Say which file is not a valid `what`, one offending field per line (the first
    `MAX_PROBLEMS_SHOWN`, then how many more there are)."""
    error_line(f"evalbus {command}: {source} is not a valid {what}:")
    for field, message in problems[:MAX_PROBLEMS_SHOWN]:
        error_line(f"  {field}: {message}")
    if len(problems) > MAX_PROBLEMS_SHOWN:
        error_line(f"  … and {len(problems) - MAX_PROBLEMS_SHOWN} more")


def resolve_target(command: str, state_dir: Path, url: str | None, token: str | None) -> GatewayTarget | None:
    """The gateway to call, or None after saying why there is none."""
    try:
        return gateway_target(state_dir, url, token)
    except TargetError as e:
        error_line(f"evalbus {command}: {e}")
        return None
