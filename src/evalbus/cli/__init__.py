"""The `evalbus` command line. One module per subcommand; each adds its parser and a `run`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from evalbus.cli import (
    baseline,
    cancel,
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
    for module in (init, up, status, down, run, tail, cancel, rejudge, compare, baseline, online, dlq, verify, replay,
                   schemas, lane, runner_key):  # fmt: skip
        module.register(commands)
    return parser


EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
"""The reader of the output went away (`evalbus status | head -3`): quiet, as a killed pipe."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the return value is the process exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser, with its usage, not the top level's
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code: int = args.run(args)
    except BrokenPipeError:
        # Python would complain again flushing stdout at exit: point it at /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return code


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command `args` were parsed for."""
    for action in parser._subparsers._group_actions if parser._subparsers is not None else ():
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest or "", None)
            if isinstance(chosen, str) and chosen in action.choices:
                return _command_parser(action.choices[chosen], args)
    return parser
