"""`python -m evalbus.runner [--job FILE|-] [--workdir DIR]`: run one case attempt in this job."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import msgspec

from evalbus.runner.run import run_job
from evalbus_contracts.runner import JOB_ENV, RunnerJob

EXIT_BAD_JOB = 2
"""Exit code when the job spec is missing or unreadable (nothing was run)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evalbus.runner", description=__doc__)
    parser.add_argument("--job", help=f"job spec file (JSON), `-` for stdin; default: ${JOB_ENV}")
    parser.add_argument("--workdir", default=".", help="where the harness runs (default: the current folder)")
    args = parser.parse_args(argv)
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


def _write_line(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
