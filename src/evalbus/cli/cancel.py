"""`evalbus cancel <batch> [--wait] [--json]`: stop a batch — no new case starts, those in flight
settle (`POST /v1/batches/{id}/cancel`). With `--wait` the command follows the batch to its end
and prints its scorecard, as `evalbus run` does.

Exit codes: 0 the cancel was accepted (with `--wait`: the batch ended, cancelled or otherwise), 1
the batch is unknown, already finalized or the gateway unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from evalbus.cli.connection import GatewayTarget, add_gateway_options
from evalbus.cli.follow import (
    EXIT_NOT_SUCCEEDED,
    api_failure,
    error_line,
    follow,
    print_outcome,
    progress_display,
    resolve_target,
)
from evalbus.cli.progress import BatchProgress
from evalbus_api.client import ApiRequestError, GatewayClient

EXIT_ACCEPTED = 0


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `cancel` parser."""
    parser = commands.add_parser(
        "cancel",
        help="cancel a batch: no new case starts, those in flight settle",
        description="Cancel a batch (POST /v1/batches/{id}/cancel): no new case starts, the cases in flight settle, "
        "and the batch ends cancelled. Ctrl-C in `evalbus run` only stops following; this stops the batch.",
    )
    parser.add_argument("batch", help="the batch to cancel")
    parser.add_argument("--wait", action="store_true", help="follow the batch to its end and print its scorecard")
    parser.add_argument("--json", action="store_true", help="print the answer (or, with --wait, the outcome) as JSON")
    add_gateway_options(parser)
    parser.set_defaults(run=run)


async def cancel(target: GatewayTarget, batch_id: str, *, wait: bool, json_output: bool) -> int:
    """Ask for the cancel (and follow the batch when asked); the exit code."""
    async with GatewayClient(target.url, target.token) as client:
        try:
            accepted = await client.cancel(batch_id)
        except ApiRequestError as e:
            error_line(api_failure(e, f"evalbus cancel: cancelling {batch_id} failed")[1])
            return EXIT_NOT_SUCCEEDED
        if not wait:
            if json_output:
                print(json.dumps({"batch_id": accepted.batch_id, "status": accepted.status, "reason": accepted.reason}))
            else:
                print(
                    f"batch {batch_id} {accepted.status} ({accepted.reason}): no new case starts, those in flight settle"
                )
            return EXIT_ACCEPTED
        if not json_output:
            print(f"batch {batch_id} {accepted.status}; following it to its end", flush=True)
        try:
            outcome = await follow(client, BatchProgress(batch_id), progress_display(json_output))
        except ApiRequestError as e:
            error_line(api_failure(e, f"evalbus cancel: following batch {batch_id} failed")[1])
            return EXIT_NOT_SUCCEEDED
        print_outcome(outcome, json_output=json_output, out=sys.stdout)
        return EXIT_ACCEPTED


def run(args: argparse.Namespace) -> int:
    """Cancel; the exit code."""
    target = resolve_target("cancel", args.dir, args.gateway, args.token)
    if target is None:
        return EXIT_NOT_SUCCEEDED
    try:
        return asyncio.run(cancel(target, args.batch, wait=args.wait, json_output=args.json))
    except KeyboardInterrupt:
        return 130
