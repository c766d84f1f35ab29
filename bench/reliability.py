"""Reliability suite: every fault scenario that exists today, run through the real services, and one
table — test, load, faults injected, cases lost, cases duplicated, max stall, pass/fail.

It runs the crash module (`tests/test_pipeline_crash.py`: each of the dispatcher, judge, exporter
and gateway SIGKILLed mid-message and, by a deterministic fault point, after its output's PubAck
and before its ack; the dispatcher also after its fan-out), which writes its figures to a JSON
report when `EVALBUS_RELIABILITY_REPORT` names one; nats-server SIGKILLed mid-batch and restarted
(`tests/test_pipeline_nats_restart.py`, same report); PostgreSQL refusing connections for 10 s
mid-batch (`tests/test_pipeline_outages.py`, its stall from the database's return to every
consumer idle); the case workdirs' disk full (`tests/test_pipeline_disk_full.py`: a harness fills the
dispatcher's small tmpfs workdir root and holds it, a case beside it and a batch submitted meanwhile
fail `disk_full`, the dispatcher keeps running, and once the hog lets go its release gives the
space back and the next batch succeeds; its stall from the let-go to that batch done and every
consumer idle; it needs root to mount the tmpfs); the online collector's crash tests
(`tests/test_online_pipeline.py`, spans and sampling stages); and the poison flood
(`bench/poison.py`: 1,000 malformed messages on every consumed subject while a batch runs, every
one dead-lettered by every consumer of its subject, the makespan within 1.10 x a clean run's);
and (`MORE_FAULTS`) a 3-node cluster whose CASES leader and a replica of every service are
SIGKILLed mid-batch (`tests/test_scaleout_cluster.py`, 1,000 cases unless `SCALEOUT_CASES`), a
model judge's provider answering 429, 500 and hanging, then hanging past the judge's retries
(`tests/test_pipeline_provider_faults.py`), a sink's endpoint down, a harness that forks a daemon,
and replicas whose clocks are 5 minutes apart — then prints the table. The stall is
the time from the kill until every consumer is idle again (the held message redelivered after its
consumer's `ack_wait` — 4 s for the case stages, 10 s for the recorder — and done); for the dispatcher
killed mid-message the table also gives the time until its orphaned cases' agents ran again, on the
restarted dispatcher and (`tests/test_pipeline_stalled_replica.py`) on a second replica that was up
all along (goal: within 10 s). Goals: 0 lost, 0 duplicated, every scenario passed.

    .venv/bin/python bench/reliability.py [--poison-per-subject 1000] [--check] [--json]

The fast parts of the issue's suite run in CI as those tests; a soak is a separate recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._goals import add_check_flag, goal, goal_notes, verdict  # noqa: E402 - after the path fix
from bench._report import report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ONLINE_CRASH = "tests/test_online_pipeline.py::test_collector_killed_mid_stream_loses_and_doubles_nothing"
NATS_RESTART = "tests/test_pipeline_nats_restart.py"
DATABASE_OUTAGE = "tests/test_pipeline_outages.py::test_a_database_outage_mid_batch_loses_and_doubles_nothing"
DISK_FULL = "tests/test_pipeline_disk_full.py"
SURVIVOR = "tests/test_pipeline_stalled_replica.py::test_a_killed_dispatchers_case_runs_again_on_the_surviving_replica"
MORE_FAULTS: tuple[tuple[str, str], ...] = (
    (
        "tests/test_scaleout_cluster.py",
        "3-node cluster: the CASES leader SIGKILLed, a replica of every service SIGKILLed",
    ),
    ("tests/test_pipeline_provider_faults.py", "judge provider answering 429, 500 and hanging"),
    (
        "tests/test_pipeline_outages.py::test_a_sink_endpoint_that_is_down_fails_visibly_and_loses_nothing",
        "a sink's endpoint down",
    ),
    ("tests/test_pipeline_daemon_harness.py", "a harness that forks a daemon and exits"),
    (
        "tests/test_pipeline_clock_skew.py::"
        "test_a_batch_through_replicas_with_skewed_clocks_is_exactly_once_and_scored_as_usual",
        "clocks skewed ±5 min between replicas",
    ),
)
"""More fault tests, each writing its rows (`evalbus.testing.reliability`): target → what it injects."""


def run_pytest(target: str, env: dict[str, str]) -> tuple[int, float, str]:
    """Exit code, seconds and the last lines of `pytest target`."""
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", target, "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-3:])
    return done.returncode, time.monotonic() - began, tail


def scenario_rows(target: str, what: str) -> tuple[list[dict[str, Any]], float]:
    """The rows `pytest target` reports (`evalbus.testing.reliability`) and its seconds; a test
    that failed after writing its rows fails them, one that wrote none gives an error row."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.json"
        code, seconds, tail = run_pytest(target, {**os.environ, "EVALBUS_RELIABILITY_REPORT": str(path)})
        found: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []
    if code != 0:
        found = [{**r, "passed": False} for r in found]
    return found or [{"test": what, "error": tail or f"exit {code}"}], seconds


def poison_row(per_subject: int) -> dict[str, Any]:
    """`bench/poison.py`: a batch under a flood of malformed messages on every consumed subject."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "poison.py"),
            "--json",
            "--repeats",
            "2",
            "--per-subject",
            str(per_subject),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        out = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {
            "test": "poison flood",
            "error": (done.stderr or done.stdout).strip()[-300:] or f"exit {done.returncode}",
        }
    flood = next(r for r in out["runs"] if r["mode"] == "flood")
    want, got = flood["dead_letters_expected"], flood["dead_letters"]
    expected_events = 4 * out["params"]["cases"] + 2
    return {
        "test": f"poison flood: makespan {out['ratio']:.3f} x clean (goal <= 1.10)",
        "load": f"{out['params']['cases']} cases + {flood['poison_sent']} poison",
        "faults": flood["poison_sent"],
        "lost": max(0, expected_events - flood["batch_events_recorded"])
        + sum(max(0, n - got.get(s, 0)) for s, n in want.items()),
        "duplicated": sum(max(0, n - want.get(s, 0)) for s, n in got.items()),
        "max_stall_s": None,
        "passed": bool(out["ok"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument(
        "--poison-per-subject", type=int, default=1000, help="malformed messages per subject kind (bench/poison.py)"
    )
    add_check_flag(parser)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "crash.json"
        env = {**os.environ, "EVALBUS_RELIABILITY_REPORT": str(report_path)}
        crash_code, crash_s, crash_tail = run_pytest("tests/test_pipeline_crash.py", env)
        rows: list[dict[str, Any]] = json.loads(report_path.read_text()) if report_path.exists() else []
    seconds: dict[str, float] = {"tests/test_pipeline_crash.py": crash_s}
    for target, what in (
        (NATS_RESTART, "SIGKILL nats-server (single node)"),
        (DATABASE_OUTAGE, "PostgreSQL unavailable mid-batch"),
        (DISK_FULL, "case workdirs' disk full"),
        (SURVIVOR, "SIGKILL dispatcher, a surviving replica"),
        *MORE_FAULTS,
        (ONLINE_CRASH, "SIGKILL collector (online)"),
    ):
        found, seconds[target] = scenario_rows(target, what)
        rows += found
    rows.append(poison_row(args.poison_per_subject))
    lost = sum(r.get("lost") or 0 for r in rows if r.get("lost") is not None)
    duplicated = sum(r.get("duplicated") or 0 for r in rows if r.get("duplicated") is not None)
    stalls = [float(r["max_stall_s"]) for r in rows if r.get("max_stall_s") is not None]
    resumed = [float(r["resumed_s"]) for r in rows if r.get("resumed_s") is not None]
    goals = [
        goal(
            "dispatcher killed mid-batch: its cases running again on a restarted or surviving replica, s after the kill",
            max(resumed) if len(resumed) >= 2 else None,
            "<=",
            10.0,
            "issue 13 (the dispatcher's 4 s ack wait, an exclusive stage); the slower of the two",
        ),
        goal("cases lost", float(lost), "==", 0, "every scenario"),
        goal("cases duplicated", float(duplicated), "==", 0, "every scenario"),
        goal("scenarios passed", float(sum(bool(r.get("passed")) for r in rows)), "==", float(len(rows)), "all"),
        goal("crash tests' exit code", float(crash_code), "==", 0, "pytest tests/test_pipeline_crash.py"),
    ]
    out: dict[str, Any] = {
        "benchmark": "reliability",
        "rows": rows,
        "max_stall_s": max(stalls) if stalls else None,
        "seconds": seconds,
        "goals": goals,
        "ok": all(g.passed for g in goals),
    }
    table = [("test", "load", "faults", "lost", "duplicated", "max stall s", "resumed s", "result")]
    for r in rows:
        if "error" in r:
            table.append((r["test"], "-", "-", "-", "-", "-", "-", f"ERROR {r['error'][:60]}"))
            continue
        stall = "-" if r.get("max_stall_s") is None else f"{r['max_stall_s']:.1f}"
        table.append(
            (
                r["test"],
                str(r["load"]),
                str(r["faults"]),
                str(r["lost"]),
                str(r["duplicated"]),
                stall,
                "-" if r.get("resumed_s") is None else f"{r['resumed_s']:.1f}",
                "pass" if r["passed"] else "FAIL",
            )
        )
    notes = [*goal_notes(goals), f"crash module: {crash_tail.splitlines()[-1] if crash_tail else '?'}"]
    report(out, table, notes, args.json)
    return verdict("reliability", goals, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
