"""Datasets benchmark: submitting a dataset far larger than a message, on a stock nats-server.

Workload (issue 9): `--cases` cases (default 20,000) with `--input-bytes`-long inputs (default
2,500: 50 MB of JSONL), on a nats-server with a stock 1 MB `max_payload`, the gateway and the
dispatcher as real processes on a fresh database (`DATABASE_URL`'s server, else the embedded one).

1. upload + validation — `POST /v1/datasets` through the CLI's own path (`evalbus.cli.upload`:
   the cases encoded a block at a time, one chunked request); the gateway checks every line
   strictly as it streams into the `datasets` object store.
2. submit — `POST /v1/batches` naming the upload by `suite.dataset_ref` (the gateway checks the
   object's meta and publishes `batch.requested` with the reference).
3. fan-out — until the CASES stream holds one `case.requested` per case: the dispatcher read the
   cases from the object store (digest checked) and published them.

Goal: upload + validation + submit + fan-out ≤ 10 s (issue 9). For scale, the same run times a
plain nats-py baseline for the same bytes — the dataset's chunks one at a time, then one message
per case of a `case.requested`'s size, 256 in flight — and prints the total as a multiple of it (a
reference figure, not a goal: the chassis' publisher batches better than that baseline). Prints a short table and the goals, then one JSON line
(only the JSON line with --json); with --check it exits 1, naming the missed goals, when any is
missed.

    uv run python bench/datasets.py [--cases 20000] [--input-bytes 2500] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/datasets.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec
from bench._goals import Goal, add_check_flag, goal, goal_notes, verdict
from bench._infra import Infra, pipeline_stack, quiet_logs, running
from bench._report import fmt, report
from bench._workload import ZERO_HARNESS
from nats.js import JetStreamContext

from evalbus.cli.upload import UploadProgress, offload_cases
from evalbus.infra.nats import MAX_PAYLOAD_ENV, STOCK_MAX_PAYLOAD
from evalbus_api.client import GatewayClient
from evalbus_contracts import BatchSpec, CasePlan, CaseRequested, CaseSpec, SuiteSpec, encode
from evalbus_runtime import connect

GOAL_S = 10.0
"""Issue 9: upload + validation + fan-out of the 20,000-case dataset within 10 s."""
_FILLER = "All work and no play makes a long problem statement. " * 100


def dataset(cases: int, input_bytes: int) -> list[CaseSpec]:
    """`cases` cases, each input `input_bytes` long, each with an expected answer."""
    return [
        CaseSpec(id=f"c{i:07d}", input=f"c{i:07d} " + _FILLER[: max(0, input_bytes - 9)], expected=f"c{i:07d}")
        for i in range(cases)
    ]


async def stream_count(js: JetStreamContext, subject: str) -> int:
    """Messages CASES holds on `subject` (a wildcard filter)."""
    info = await js.stream_info("CASES", subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def wait_count(js: JetStreamContext, subject: str, count: int, timeout_s: float) -> float:
    """Seconds until CASES holds `count` messages on `subject` (polled every 20 ms)."""
    started = time.monotonic()
    while await stream_count(js, subject) < count:
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{subject}: fewer than {count} messages after {timeout_s:.0f} s")
        await asyncio.sleep(0.02)  # polling an observable condition with a deadline
    return time.monotonic() - started


async def baseline_s(js: JetStreamContext, body_bytes: int, cases: list[CaseSpec]) -> float:
    """Plain nats-py for the same bytes: the dataset's chunks (128 KiB, in order), then one message
    per case of a `case.requested`'s size, 256 in flight."""
    subject = f"case.requested.baseline{uuid.uuid4().hex[:8]}"
    sample = CaseRequested(
        batch_id="baseline",
        case_id=cases[0].id,
        run_id="evb-baseline",
        case=cases[0],
        harness=ZERO_HARNESS,
        plan=CasePlan(),
    )
    message = encode(sample)
    chunk = b"x" * (128 * 1024)
    window = asyncio.Semaphore(256)

    async def one(data: bytes, at: str) -> None:
        async with window:
            await js.publish(at, data, stream="CASES")

    started = time.monotonic()
    for _ in range(body_bytes // len(chunk) + 1):
        await js.publish(subject + ".chunks", chunk, stream="CASES")
    await asyncio.gather(*(one(message, f"{subject}.{i}") for i in range(len(cases))))
    return time.monotonic() - started


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    cases = dataset(args.cases, args.input_bytes)
    body_bytes = sum(len(msgspec.json.encode(c)) + 1 for c in cases)
    spec = BatchSpec(suite=SuiteSpec(id="bench-datasets", cases=tuple(cases)), harness=ZERO_HARNESS)
    async with Infra(database=True, prefix="evalbus-bench-datasets-") as infra:
        stack = pipeline_stack(infra, "stack", service_env={"dispatcher": {"DISPATCHER_SLOTS": "1"}})
        async with running(stack):
            await asyncio.to_thread(stack.start_all, ("gateway", "dispatcher"))
            nc = await connect(infra.nats_url, "bench-datasets")
            js = nc.jetstream()
            try:
                max_payload = int(nc.max_payload)
                async with GatewayClient(stack.gateway_url, stack.admin_token, timeout_s=120.0) as gw:
                    started = time.monotonic()
                    named = await offload_cases(gw, spec, UploadProgress(len(cases), quiet=True))
                    uploaded_at = time.monotonic()
                    accepted = await gw.submit(named)
                    submitted_at = time.monotonic()
                    fanout = await wait_count(js, f"case.requested.{accepted.batch_id}.>", len(cases), 300.0)
                    total = time.monotonic() - started
                    await gw.cancel(accepted.batch_id)
                assert named.suite.dataset_ref is not None
                baseline = await baseline_s(js, body_bytes, cases)
            finally:
                await nc.close()
    return {
        "benchmark": "datasets",
        "cases": len(cases),
        "dataset_bytes": named.suite.dataset_ref.size,
        "max_payload": max_payload,
        "upload_validate_s": uploaded_at - started,
        "submit_s": submitted_at - uploaded_at,
        "fanout_s": fanout,
        "total_s": total,
        "upload_mb_per_s": named.suite.dataset_ref.size / 1e6 / (uploaded_at - started),
        "baseline_s": baseline,
        "total_over_baseline": total / baseline if baseline > 0 else float("nan"),
        "database": infra.database_source,
    }


def goals_of(out: dict[str, Any]) -> list[Goal]:
    return [
        goal("upload + validation + fan-out (s)", out["total_s"], "<=", GOAL_S, "issue 9, 20,000 cases / 50 MB"),
        goal("max_payload (bytes)", out["max_payload"], "==", STOCK_MAX_PAYLOAD, "a stock nats-server"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20_000)
    parser.add_argument("--input-bytes", type=int, default=2_500)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    quiet_logs()
    # The benchmark's nats-server is a stock one: what does not fit a message must go off the bus.
    os.environ[MAX_PAYLOAD_ENV] = str(STOCK_MAX_PAYLOAD)
    out = asyncio.run(measure(args))
    goals = goals_of(out)
    out["goals"] = [msgspec.to_builtins(g) for g in goals]
    out["ok"] = all(g.passed for g in goals)
    rows = [
        ("stage", "seconds"),
        (
            f"upload + validation ({out['dataset_bytes'] / 1e6:.1f} MB, {out['upload_mb_per_s']:.0f} MB/s)",
            fmt(out["upload_validate_s"], " s"),
        ),
        ("submit (batch names the dataset)", fmt(out["submit_s"], " s")),
        (f"fan-out ({out['cases']:,} case.requested)", fmt(out["fanout_s"], " s")),
        ("total", fmt(out["total_s"], " s")),
        ("plain nats-py, same bytes (reference)", fmt(out["baseline_s"], " s")),
        ("total / reference", fmt(out["total_over_baseline"], "x")),
    ]
    report(out, rows, goal_notes(goals), args.json)
    return verdict("datasets", goals, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
