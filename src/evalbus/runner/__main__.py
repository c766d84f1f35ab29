"""`python -m evalbus.runner [--job FILE|-] [--workdir DIR]`: run one case attempt in this job;
`--exec COMMAND`: run a live exec in the job's workdir, the job's secret values masked in its output;
`--send-file PATH [--max-bytes N]`: write the workdir's file PATH to stdout (a declared artifact
the dispatcher collects)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from pathlib import Path

import msgspec

from evalbus.runner.run import exec_masked, run_job, send_file
from evalbus_contracts.runner import JOB_ENV, RunnerJob

EXIT_BAD_JOB = 2
"""Exit code when the job spec is missing or unreadable (nothing was run)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evalbus.runner", description=__doc__)
    parser.add_argument("--job", help=f"job spec file (JSON), `-` for stdin; default: ${JOB_ENV}")
    parser.add_argument("--workdir", default=".", help="where the harness runs (default: the current folder)")
    parser.add_argument(
        "--exec", dest="command", help="run this shell command in the workdir instead, its output masked"
    )
    parser.add_argument("--send-file", dest="send", help="write this workdir file to stdout instead")
    parser.add_argument("--max-bytes", type=int, default=256 * 1024 * 1024, help="refuse a larger --send-file")
    args = parser.parse_args(argv)
    if args.send is not None:
        return send_file(Path(args.workdir), args.send, args.max_bytes, sys.stdout.buffer, _write_err)
    if args.command is not None:
        return _exec(args.command, Path(args.workdir))
    if args.job == "-":
        raw = sys.stdin.buffer.read()
    elif args.job:
        raw = Path(args.job).read_bytes()
    else:
        raw = os.environ.get(JOB_ENV, "").encode("utf-8")
    if not raw.strip():
        print(f"evalbus.runner: no job spec (give --job or set {JOB_ENV})", file=sys.stderr)
        return EXIT_BAD_JOB
    try:
        job = msgspec.json.decode(raw, type=RunnerJob)
    except msgspec.DecodeError as e:
        print(f"evalbus.runner: the job spec is invalid: {e}", file=sys.stderr)
        return EXIT_BAD_JOB
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(run_job(job, workdir=workdir, environ=os.environ, write=_write_line))


def _exec(command: str, workdir: Path) -> int:
    """A live exec: the secrets to mask are the job's (`EVALBUS_JOB` in this environment), and the
    runner's own NATS token."""
    secret_vars: tuple[str, ...] = ()
    masked: tuple[str, ...] = ()
    with contextlib.suppress(msgspec.DecodeError):
        named = msgspec.json.decode(os.environ.get(JOB_ENV, "") or "{}", type=_Secrets)
        secret_vars = named.secret_vars
        if named.live is not None and named.live.token:
            masked = (named.live.token,)
    return asyncio.run(
        exec_masked(
            command,
            workdir=workdir.resolve() if workdir.is_dir() else Path.cwd(),  # before the harness made it
            environ=os.environ,
            secret_vars=secret_vars,
            write_out=_write_line,
            write_err=_write_err,
            masked=masked,
        )
    )


class _LiveVar(msgspec.Struct, frozen=True):
    token: str | None = None


class _Secrets(msgspec.Struct, frozen=True):
    secret_vars: tuple[str, ...] = ()
    live: _LiveVar | None = None


def _write_err(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _write_line(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
