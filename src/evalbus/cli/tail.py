"""`evalbus tail <batch> [--json]`: a batch's events as they happen, one line each, from its first
event until it settles (`batch.finalized`). A dropped connection is resumed after the last event
seen (`Last-Event-ID`), so no event is lost or repeated.

    16:33:34.258  batch.requested  -          30 runs by admin
    16:33:36.515  case.executed    math-01    succeeded
    16:33:36.518  case.judged      math-01    judged
    16:33:38.131  batch.finalized  -          succeeded

`--json` prints each event as one JSON line: `{"seq", "type", "event"}` — the stream sequence, the
event type and the event as published; the closing `end` line carries `{"batch_id", "status"}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from evalbus.cli.connection import GatewayTarget, TargetError, add_gateway_options, gateway_target
from evalbus.cli.follow import EXIT_FINALIZED, EXIT_NOT_SUCCEEDED, api_failure
from evalbus.cli.progress import BatchProgress
from evalbus_api.client import END_EVENT, ApiRequestError, GatewayClient, SseEvent
from evalbus_api.live import RunStreamEnd
from evalbus_api.models import StreamEnd
from evalbus_contracts import (
    BatchCancelled,
    BatchFinalized,
    BatchRequested,
    CaseCollected,
    CaseExecuted,
    CaseExported,
    CaseJudged,
    CaseRequested,
    DecodeError,
    Event,
    expected_runs,
)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `tail` parser."""
    parser = commands.add_parser(
        "tail",
        help="follow a batch's events live until it settles",
        description="Print a batch's events (time, type, case, status) from its first one, live, until the batch "
        "is finalized; resumes after a dropped connection. Exit 0 when it finalized `succeeded`, 1 otherwise.",
    )
    parser.add_argument("batch", help="batch id")
    parser.add_argument("--json", action="store_true", help='one JSON line per event: {"seq", "type", "event"}')
    parser.add_argument("--after", type=int, default=None, metavar="SEQ", help="start after this stream sequence")
    add_gateway_options(parser)
    parser.set_defaults(run=run)


def event_status(event: Event) -> str:
    """What the status column says about an event."""
    match event:
        case BatchRequested():
            runs = expected_runs(event.spec)
            text = f"{runs} runs by {event.submitted_by}"
            return text + (f", re-judging {event.rejudge_of}" if event.rejudge_of else "")
        case BatchCancelled():
            return event.reason + (f" by {event.by}" if event.by else "")
        case BatchFinalized():
            return event.status + (f": {event.error.code}" if event.error is not None else "")
        case CaseRequested():
            return "requested" + (f" (attempt {event.attempt})" if event.attempt > 1 else "")
        case CaseExecuted():
            failure = event.result.failure
            text = event.status + (f" ({failure.code})" if failure is not None else "")
            return text + ("" if event.trace_complete else ", trace deferred")
        case CaseCollected():
            return "collected"
        case CaseJudged():
            return event.status + (f" (judge error: {event.judge_error})" if event.judge_error else "")
        case CaseExported():
            return event.status
        case _:
            return ""


def event_line(event: Event) -> str:
    """One event as a line: time, type, case (with the trial), status."""
    ts = event.ts.strftime("%H:%M:%S.%f")[:-3]
    case = event.case_id or "-"
    trial = getattr(event, "trial", None)
    if trial is None and isinstance(event, CaseExecuted | CaseCollected | CaseJudged):
        trial = event.result.trial
    if trial is not None:
        case += f" #{trial}"
    return f"{ts}  {event.type:<16} {case:<20} {event_status(event)}".rstrip()


def json_event(sse: SseEvent) -> str:
    """One server-sent event as a JSON line."""
    try:
        data: Any = json.loads(sse.data)
    except ValueError:
        data = sse.data
    return json.dumps({"seq": sse.id, "type": sse.event, "event": data})


async def tail(target: GatewayTarget, batch_id: str, *, json_output: bool, after: int | None) -> int:
    """Print the batch's events until its end; the exit code."""
    progress = BatchProgress(batch_id)
    async with GatewayClient(target.url, target.token) as client:
        async for sse in client.events(batch_id, last_event_id=after):
            progress.apply_sse(sse)
            if json_output:
                print(json_event(sse), flush=True)
            elif sse.event == END_EVENT:
                print(f"end: batch {batch_id} {progress.status}", flush=True)
            else:
                try:
                    event = sse.decoded()
                    if not isinstance(event, StreamEnd | RunStreamEnd):
                        print(event_line(event), flush=True)
                except DecodeError:
                    print(f"{sse.event:<16} (undecodable event at sequence {sse.id})", flush=True)
    return EXIT_FINALIZED if progress.status == "succeeded" else EXIT_NOT_SUCCEEDED


def run(args: argparse.Namespace) -> int:
    """Follow the batch; 0 when it finalized `succeeded`."""
    try:
        target = gateway_target(args.dir, args.gateway, args.token)
        return asyncio.run(tail(target, args.batch, json_output=args.json, after=args.after))
    except TargetError as e:
        print(f"evalbus tail: {e}", file=sys.stderr)
        return EXIT_NOT_SUCCEEDED
    except ApiRequestError as e:
        print(api_failure(e, f"evalbus tail {args.batch}")[1], file=sys.stderr)
        return EXIT_NOT_SUCCEEDED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader left (`evalbus tail … | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
