"""The `evalbus` command line. One module per subcommand; each adds its parser and a `run`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from evalbus.cli import (
    baseline,
    compare,
    dlq,
    down,
    init,
    lane,
    online,
    rejudge,
    replay,
    run,
    runner_key,
    schemas,
    status,
    tail,
    up,
    verify,
)


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="evalbus", description="Event-sourced evaluation of AI agents over NATS JetStream."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (init, up, status, down, run, tail, rejudge, compare, baseline, online, dlq, verify, replay, schemas, lane,
                   runner_key):  # fmt: skip
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the return value is the process exit code."""
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code
