"""`evalbus rejudge <batch> [--judges FILE|JSON]`: judge a finalized batch again, executing nothing.

The gateway creates a new batch whose runs are the old batch's `case.executed` events replayed to
the judges (`POST /v1/batches/{id}/rejudge`); this command then follows the new batch like
`evalbus run` does — progress bars, then the scorecard (`--json`: one JSON line with
`rejudge_of`). `--judges` is a YAML or JSON file, or inline JSON, holding a list of judges (or a
mapping with `judges:`, so a suite file works too); without it the old batch's judges are used.

Exit codes as for `run`: 0 finalized `succeeded`, 1 failed or cancelled, 2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from evalbus.cli.connection import GatewayTarget, add_gateway_options
from evalbus.cli.follow import (
    EXIT_BAD_INPUT,
    EXIT_FINALIZED,
    EXIT_NOT_SUCCEEDED,
    api_failure,
    error_line,
    follow,
    print_outcome,
    progress_display,
    report_spec_problems,
    resolve_target,
)
from evalbus.cli.progress import BatchProgress
from evalbus.cli.scorecard import json_line
from evalbus.cli.suite_file import SpecFileError, load_judges
from evalbus_api.client import ApiRequestError, GatewayClient
from evalbus_contracts import JudgeSpec


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `rejudge` parser."""
    parser = commands.add_parser(
        "rejudge",
        help="judge a finalized batch again (other judges), executing nothing",
        description="Create a new batch from a finalized one whose executed cases are replayed to the judges "
        "(nothing runs again), follow it, and print its scorecard.",
    )
    parser.add_argument("batch", help="the finalized batch to re-judge")
    parser.add_argument(
        "--judges",
        default=None,
        metavar="FILE|JSON",
        help="judges of the new batch: a YAML/JSON file or inline JSON list (default: the old batch's judges)",
    )
    parser.add_argument(
        "--json", action="store_true", help='print only {"batch_id", "status", "summary", "rejudge_of"} as JSON'
    )
    parser.add_argument("--no-wait", action="store_true", help="print the new batch id; do not follow it")
    add_gateway_options(parser)
    parser.set_defaults(run=run)


async def rejudge(
    target: GatewayTarget, old_id: str, judges: tuple[JudgeSpec, ...] | None, *, json_output: bool, no_wait: bool
) -> int:
    """Ask for the re-judge, follow the new batch, print the outcome; the exit code."""
    client = GatewayClient(target.url, target.token)
    async with client:
        try:
            accepted = await client.rejudge(old_id, judges)
        except ApiRequestError as e:
            code, message = api_failure(e, f"re-judging {old_id} failed")
            error_line(message)
            return code
        new_id = accepted.batch_id
        if no_wait:
            if json_output:
                print(json.dumps(json_line(new_id, accepted.status, None, rejudge_of=old_id)))
            else:
                print(f"batch {new_id} re-judges {old_id}; follow it with: evalbus tail {new_id}")
            return EXIT_FINALIZED
        if not json_output:
            print(f"batch {new_id} re-judges {old_id}  (evalbus tail {new_id})", flush=True)
        try:
            outcome = await follow(client, BatchProgress(new_id), progress_display(json_output))
        except ApiRequestError as e:
            error_line(api_failure(e, f"following batch {new_id} failed")[1])
            return EXIT_NOT_SUCCEEDED
        except asyncio.CancelledError:  # Ctrl-C
            error_line(f"\nstopped following; batch {new_id} goes on: evalbus tail {new_id}")
            raise
        print_outcome(outcome, json_output=json_output, out=sys.stdout, rejudge_of=old_id)
        return outcome.exit_code


def run(args: argparse.Namespace) -> int:
    """Re-judge and follow; the exit code."""
    judges = None
    if args.judges is not None:
        try:
            judges = load_judges(args.judges)
        except SpecFileError as e:
            report_spec_problems("rejudge", "list of judges", e.source, e.problems)
            return EXIT_BAD_INPUT
    target = resolve_target("rejudge", args.dir, args.gateway, args.token)
    if target is None:
        return EXIT_NOT_SUCCEEDED
    try:
        return asyncio.run(rejudge(target, args.batch, judges, json_output=args.json, no_wait=args.no_wait))
    except KeyboardInterrupt:
        return 130
