"""Adaptive judge concurrency against a rate-limited provider (issue 12).

Workload: the local chat-completions server (`evalbus.testing.chat_server`) enforcing `--limit`
(20) requests per wall-clock second, 429 + `Retry-After` past it, each request taking `--latency-s`
(1 s: a model's thinking time), with the `x-ratelimit-*` headers providers send. Two judge
"replicas" (each its own NATS connection, chat client and provider limits, in this process) judge
cases with the real model judge (`ChatModelJudge`), `--workers` (64) cases in flight each — as the
judge service's stage would — for `--seconds` (60) per mode, the modes (`--modes`, all three by
default) one after the other in the same run:

- `adaptive`: the provider's limit shared by both replicas in the `JUDGE_LIMITS` key-value bucket
  of a real nats-server (AIMD, `evalbus_judge.limits`), ceiling `--ceiling` (32);
- `fixed-4` and `fixed-32`: no adaptive limit, the old fixed concurrency (4, or 32) across both
  replicas; a 429 is retried after its `Retry-After` as before.

Figures per mode: accepted (200) requests per second over the whole run, from a cold start (a
provider the `JUDGE_LIMITS` bucket has never seen), and after its first `--warmup-s` (10) seconds
(the steady rate), 429s as a fraction of all answers of the run, judged cases, the adaptive limit
as each replica last saw it, and second by second: 200s, 429s, the limit and the calls in flight
(to see where a shortfall is: the start, or the steady state).

Goals: adaptive accepted rate over the whole run (its start included) ≥ 0.9 × the limit, adaptive
429s ≤ 2 % of all answers; printed beside the fixed modes measured in the same run.

    uv run python bench/ratelimit.py [--limit 20] [--latency-s 1.0] [--seconds 60] [--warmup-s 10]
        [--workers 64] [--ceiling 32] [--modes adaptive fixed-4 fixed-32] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/ratelimit.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._goals import add_check_flag, goal, goal_notes, verdict
from bench._infra import Infra, quiet_logs
from bench._report import fmt, report

from evalbus.testing.chat_server import ChatCompletionsServer, RateLimit
from evalbus_contracts import CaseResult, Measured, Message, ModelJudge
from evalbus_judge import ChatClient, ChatModelJudge, JudgeContext, RetryPolicy
from evalbus_judge.limits import ProviderLimits
from evalbus_runtime import connect
from evalbus_runtime.secrets import SecretStore

REPLICAS = 2
"""Judge replicas sharing the provider."""
MODES = ("adaptive", "fixed-4", "fixed-32")


def context(n: int) -> JudgeContext:
    trace = (Message(role="user", text=f"question {n}"), Message(role="assistant", text=f"answer {n}"))
    result = CaseResult(case_id=f"c{n}", run_id=f"evb-bench-c{n}", harness="bench@1", answer=f"answer {n}", trace=trace)
    return JudgeContext.of(result, case_input=f"question {n}", expected=None)


async def run_mode(mode: str, infra: Infra, server: ChatCompletionsServer, args: argparse.Namespace) -> dict[str, Any]:
    """Judge cases for `args.seconds` in one mode; the server's answers in that time."""
    spec = ModelJudge(id="quality", base_url=f"{server.root}/v1", model=f"bench-{mode}", rubric="r", timeout_s=30.0)
    fixed = {"fixed-4": 4, "fixed-32": 32}.get(mode)
    connections = [await connect(infra.nats_url, f"ratelimit-{mode}-{i}") for i in range(REPLICAS)]
    limits: list[ProviderLimits] = []
    clients: list[ChatClient] = []
    retry = RetryPolicy(max_total_wait_s=120.0)
    for nc in connections:
        provider_limits = None
        if fixed is None:
            provider_limits = ProviderLimits(ceiling=args.ceiling)
            await provider_limits.start(nc.jetstream())
            limits.append(provider_limits)
        client = ChatClient(retry, limits=provider_limits)
        await client.start()
        clients.append(client)
    # a fixed concurrency across both replicas is the old consumer's max_ack_pending
    shared = asyncio.Semaphore(fixed) if fixed is not None else None
    judged = measured = 0
    stop_at = time.monotonic() + args.seconds
    first_answer = len(server.answered)

    async def worker(client: ChatClient, w: int) -> None:
        nonlocal judged, measured
        judge = ChatModelJudge(
            spec, chat=client, base_url=spec.base_url or "", api_key_secret=None, secrets=SecretStore()
        )
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            async with shared or contextlib.nullcontext():
                if time.monotonic() >= stop_at:  # waited past the end for a fixed slot
                    break
                score = await judge.judge(context(w * 1_000_000 + n))
            judged += 1
            measured += isinstance(score, Measured)

    async def sample(started: float) -> None:
        """The adaptive limit (as the first replica sees it) and the calls in flight, once a second."""
        for s in range(math.ceil(args.seconds)):
            await asyncio.sleep(max(0.0, started + s + 1 - time.monotonic()))
            limiters = [limiter for pl in limits for limiter in pl._limiters.values()]
            limit_each_s.append(limiters[0].state.limit if limiters else float("nan"))
            in_flight_each_s.append(sum(limiter.in_flight for limiter in limiters))

    limit_each_s: list[float] = []
    in_flight_each_s: list[int] = []
    started = time.monotonic()
    sampler = asyncio.create_task(sample(started)) if limits else None
    await asyncio.gather(*(worker(c, i * args.workers + w) for i, c in enumerate(clients) for w in range(args.workers)))
    elapsed = time.monotonic() - started
    if sampler is not None:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    answers = server.answered[first_answer:]
    window = [(at, status) for at, status in answers if at <= started + args.seconds]
    accepted = sum(1 for _, s in window if s == 200)
    refused = sum(1 for _, s in window if s == 429)
    steady_s = args.seconds - args.warmup_s
    steady = sum(1 for at, s in window if s == 200 and at > started + args.warmup_s)
    seconds = math.ceil(args.seconds)
    accepted_each_s = [0] * seconds
    refused_each_s = [0] * seconds
    for at, status in window:
        second = min(seconds - 1, int(at - started))
        if status == 200:
            accepted_each_s[second] += 1
        elif status == 429:
            refused_each_s[second] += 1
    seen = [limiter.state.limit for pl in limits for limiter in pl._limiters.values()]
    for client in clients:
        await client.close()
    for provider_limits in limits:
        await provider_limits.close()
    for nc in connections:
        await nc.close()
    return {
        "mode": mode,
        "seconds": args.seconds,
        "accepted_per_s": accepted / args.seconds,
        "ratio_to_limit": accepted / args.seconds / args.limit,
        "steady_accepted_per_s": steady / steady_s,
        "steady_ratio_to_limit": steady / steady_s / args.limit,
        "answers": len(window),
        "refused_429": refused,
        "refused_fraction": refused / len(window) if window else float("nan"),
        "judged": judged,
        "measured": measured,
        "drain_s": elapsed - args.seconds,
        "limit_seen": seen,
        "accepted_each_s": accepted_each_s,
        "refused_each_s": refused_each_s,
        "limit_each_s": limit_each_s,
        "in_flight_each_s": in_flight_each_s,
    }


async def main(args: argparse.Namespace) -> int:
    quiet_logs()
    server = ChatCompletionsServer()
    await server.start()
    server.rate_limit = RateLimit(per_s=args.limit, latency_s=args.latency_s)
    modes: list[dict[str, Any]] = []
    try:
        async with Infra(database=False, prefix="evalbus-bench-ratelimit-") as infra:
            for mode in args.modes:
                modes.append(await run_mode(mode, infra, server, args))
                await asyncio.sleep(1.0)  # let the provider's window roll over between modes
    finally:
        await server.stop()
    adaptive = next((m for m in modes if m["mode"] == "adaptive"), {"ratio_to_limit": None, "refused_fraction": None})
    goals = [
        goal(
            "adaptive accepted rate / limit",
            adaptive["ratio_to_limit"],
            ">=",
            0.9,
            f"the server's {args.limit} req/s, {REPLICAS} replicas sharing it, over the whole "
            f"{args.seconds:g} s from a cold start",
        ),
        goal(
            "adaptive 429 fraction",
            adaptive["refused_fraction"],
            "<=",
            0.02,
            "of all answers in the run, its start included",
        ),
    ]
    out = {
        "benchmark": "ratelimit",
        "limit_per_s": args.limit,
        "latency_s": args.latency_s,
        "replicas": REPLICAS,
        "workers_per_replica": args.workers,
        "ceiling": args.ceiling,
        "modes": modes,
        "goals": goals,
        "ok": all(g.passed for g in goals),
    }
    rows = [
        (
            "mode",
            "accepted/s",
            "× limit",
            "steady/s",
            "× limit",
            "answers",
            "429s",
            "429 %",
            "judged",
            "measured",
            "limit seen",
        )
    ]
    for m in modes:
        rows.append(
            (
                m["mode"],
                fmt(m["accepted_per_s"], digits=1),
                fmt(m["ratio_to_limit"]),
                fmt(m["steady_accepted_per_s"], digits=1),
                fmt(m["steady_ratio_to_limit"]),
                str(m["answers"]),
                str(m["refused_429"]),
                fmt(100 * m["refused_fraction"], digits=1),
                str(m["judged"]),
                str(m["measured"]),
                ", ".join(f"{x:.1f}" for x in m["limit_seen"]) or "-",
            )
        )
    report(out, rows, [*goal_notes(goals), *per_second(modes)], args.json)
    return verdict("ratelimit", goals, check=args.check)


def per_second(modes: list[dict[str, Any]]) -> list[str]:
    """Each mode's second-by-second figures, to see where a shortfall is (the start, the steady state)."""
    lines = ["per second (200s / 429s; adaptive: the limit as the first replica saw it, calls in flight):"]
    for m in modes:
        lines.append(f"  {m['mode']:>8} 200: {' '.join(f'{n:2d}' for n in m['accepted_each_s'])}")
        lines.append(f"  {'':>8} 429: {' '.join(f'{n:2d}' for n in m['refused_each_s'])}")
        if m["limit_each_s"]:
            lines.append(f"  {'':>8} lim: {' '.join(f'{x:2.0f}' for x in m['limit_each_s'])}")
            lines.append(f"  {'':>8} fly: {' '.join(f'{n:2d}' for n in m['in_flight_each_s'])}")
    return lines


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=20, help="requests per second the server accepts")
    parser.add_argument("--latency-s", type=float, default=1.0, help="seconds each request takes")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of load per mode")
    parser.add_argument("--warmup-s", type=float, default=10.0, help="seconds at the start left out of the steady rate")
    parser.add_argument("--workers", type=int, default=64, help="cases in flight per replica")
    parser.add_argument("--ceiling", type=int, default=32, help="JUDGE_GLOBAL_LIMIT: the adaptive limit's ceiling")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="modes to run (the goals need adaptive; the fixed ones are its comparison)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    add_check_flag(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
