"""`evalbus baseline set SUITE BATCH` and `evalbus baseline show SUITE`: the batch a suite's
comparisons and regression gates default to (`PUT|GET /v1/suites/{suite}/baseline`).

Only a batch of the suite that finalized `succeeded` can be a baseline: the gateway refuses a
superseded, cancelled or failed one (409), and the command says why. Exit codes: 0 done, 1 refused
(unknown batch, another suite's, not succeeded, no baseline yet) or the gateway could not be used,
2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from evalbus.cli.connection import add_gateway_options
from evalbus.cli.follow import EXIT_FINALIZED, EXIT_NOT_SUCCEEDED, api_failure, error_line, resolve_target
from evalbus_api.client import ApiRequestError, GatewayClient
from evalbus_api.compare import BaselineView
from evalbus_contracts import to_builtins


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `baseline` parser and its subcommands."""
    parser = commands.add_parser(
        "baseline",
        help="a suite's baseline batch (what compare and regression gates default to)",
        description="Set or show the batch a suite's comparisons and regression gates default to.",
    )
    sub = parser.add_subparsers(dest="baseline_command", required=True, metavar="SUBCOMMAND")
    set_parser = sub.add_parser("set", help="make a batch (finalized succeeded) its suite's baseline")
    set_parser.add_argument("suite")
    set_parser.add_argument("batch")
    show = sub.add_parser("show", help="a suite's baseline")
    show.add_argument("suite")
    for each in (set_parser, show):
        each.add_argument("--json", action="store_true", help="print the API's answer as JSON")
        add_gateway_options(each)
        each.set_defaults(run=run)


def describe(view: BaselineView) -> str:
    """One line."""
    return f"baseline of {view.suite_id}: {view.batch_id} (set by {view.set_by} at {view.set_at:%Y-%m-%d %H:%M:%S}Z)"


async def _call(args: argparse.Namespace) -> int:
    target = resolve_target("baseline", args.dir, args.gateway, args.token)
    if target is None:
        return EXIT_NOT_SUCCEEDED
    async with GatewayClient(target.url, target.token) as client:
        try:
            if args.baseline_command == "set":
                view = await client.set_baseline(args.suite, args.batch)
            else:
                view = await client.baseline(args.suite)
        except ApiRequestError as e:
            code, message = api_failure(e, f"baseline {args.baseline_command}")
            error_line(message)
            return code
    print(json.dumps(to_builtins(view)) if args.json else describe(view))
    return EXIT_FINALIZED


def run(args: argparse.Namespace) -> int:
    """Set or show; the exit code."""
    return asyncio.run(_call(args))
