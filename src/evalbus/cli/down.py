"""`evalbus down`: stop everything `evalbus up` started, by its recorded pids."""

from __future__ import annotations

import argparse
import sys

from evalbus.cli.options import add_dir_option
from evalbus.infra.stack import bring_down


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `down` parser."""
    parser = commands.add_parser(
        "down",
        help="stop the local stack",
        description="Stop the services (SIGTERM, SIGKILL after --timeout), nats-server and the embedded "
        "PostgreSQL that `evalbus up` started; keep their data and remembered ports.",
    )
    add_dir_option(parser)
    parser.add_argument(
        "--timeout",
        type=float,
        default=40.0,
        help="seconds a process gets to exit before SIGKILL (default: 40, more than a service's 30 s graceful shutdown)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Stop the stack; 0 when nothing it started is left running."""
    try:
        endpoints = bring_down(args.dir, args.timeout, say=lambda line: print(f"  {line}", flush=True))
    except RuntimeError as e:
        print(f"evalbus down failed: {e}", file=sys.stderr)
        return 1
    if endpoints is None:
        print(f"nothing to stop: evalbus was never up in {args.dir}")
    else:
        print(f"evalbus is down ({args.dir})")
    return 0
