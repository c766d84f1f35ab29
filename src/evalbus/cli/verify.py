"""`evalbus verify <run-or-batch>`: recompute the hash chain of sealed trajectories from the event
store and compare it with the seals written when the runs settled.

A batch id verifies every run of the batch; anything else is taken as a run id. Each run is `ok`,
`MISMATCH at seq N` (an event altered, removed or added after sealing, or an object it names — a
large result's payload, a stored artifact — replaced or altered in the object store) or `NOT
SEALED` (still in flight, or unknown). Objects are read from the stack's NATS (`--nats`;
`--no-objects` checks the chains only). Exit 0 only when every run is sealed and intact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import asyncpg
import msgspec
import nats as natslib
from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError

from evalbus.cli.connection import TargetError, add_database_options, database_url, nats_url
from evalbus.infra.endpoints import redact_url
from evalbus_runtime.payloads import first_bad_object, object_refs

# The event store is the gateway's: imported when the command runs, so that `evalbus.cli`, which
# registers every command, imports no service.
if TYPE_CHECKING:
    from evalbus_gateway.store import VerifyResult


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `verify` parser."""
    parser = commands.add_parser(
        "verify",
        help="recompute the hash chains of a run or a batch",
        description="Recompute each run's SHA-256 hash chain from the event store and compare it with its seal. "
        "Exit 0 only when every run is sealed and intact.",
    )
    parser.add_argument("id", help="a batch id (every run of it) or a run id")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON document")
    parser.add_argument(
        "--no-objects",
        action="store_true",
        help="check the hash chains only, not the objects (large payloads, artifacts) the events name",
    )
    parser.add_argument("--nats", help="NATS URL of the object store (default: the stack's, else NATS_URL)")
    add_database_options(parser)
    parser.set_defaults(run=run)


def result_line(result: VerifyResult) -> str:
    """One run's verdict."""
    if result.status == "ok":
        objects = f", {result.objects_checked} objects" if result.objects_checked else ""
        head = (result.sealed_head or "")[:16]
        return f"ok          {result.run_id}  ({result.event_count} events{objects}, head {head})"
    if result.status == "mismatch":
        return f"MISMATCH    {result.run_id}  at seq {result.first_bad_seq}: {result.detail}"
    return f"NOT SEALED  {result.run_id}  ({result.event_count} events: {result.detail})"


def summary_line(kind: str, target: str, results: Sequence[VerifyResult]) -> str:
    """The closing line: counts by status."""
    ok = sum(r.status == "ok" for r in results)
    bad = sum(r.status == "mismatch" for r in results)
    unsealed = sum(r.status == "not_sealed" for r in results)
    verdict = "ok" if ok == len(results) and results else "NOT OK"
    return f"{kind} {target}: {verdict} — {ok} ok, {bad} mismatched, {unsealed} not sealed"


async def verify(url: str, target: str, nats: Callable[[], str] | None = None) -> tuple[str, list[VerifyResult]]:
    """(`batch` or `run`, results): the batch's runs when `target` is a batch with events, else the
    run. With `nats` (the URL, asked for only once a run names an object), every object the events
    name is read and checked against its reference."""
    from evalbus_gateway.store import verify_batch, verify_run

    conn = await asyncpg.connect(url)
    nc: NatsClient | None = None

    async def objects(events: list[tuple[int, str]]) -> tuple[int | None, str | None, int]:
        nonlocal nc
        if not any(next(object_refs(msgspec.json.decode(body)), None) is not None for _, body in events):
            return None, None, 0
        if nc is None:
            assert nats is not None
            nc = await natslib.connect(
                servers=[nats()], name="evalbus-verify", connect_timeout=5, max_reconnect_attempts=3
            )
        return await first_bad_object(nc.jetstream(), events)

    check = None if nats is None else objects
    try:
        batch = await verify_batch(conn, target, check)
        if batch.runs:
            return "batch", list(batch.runs)
        return "run", [await verify_run(conn, target, check)]
    finally:
        await conn.close()
        if nc is not None:
            await nc.close()


def _object_store(args: argparse.Namespace) -> str:
    try:
        return nats_url(args.dir, args.nats)
    except TargetError as e:
        raise TargetError(
            f"the events name objects in the object store, which need a NATS server to check: {e} "
            "(--no-objects checks the hash chains only)"
        ) from e


def run(args: argparse.Namespace) -> int:
    """Verify and print; 0 only when every run is ok."""
    try:
        url = database_url(args.dir, args.database)
        nats = None if args.no_objects else lambda: _object_store(args)
        kind, results = asyncio.run(verify(url, args.id, nats))
    except TargetError as e:
        print(f"evalbus verify: {e}", file=sys.stderr)
        return 1
    except asyncpg.UndefinedTableError:
        print(
            f"evalbus verify: {redact_url(url)} holds no event store: name the database `evalbus up` made "
            "(the `database` of .evalbus/endpoints.json, found by --dir), not its server's",
            file=sys.stderr,
        )
        return 1
    except (OSError, asyncpg.PostgresError) as e:
        print(f"evalbus verify: the event store is unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except NatsError as e:
        print(
            f"evalbus verify: the object store is unavailable: {type(e).__name__}: {e} (--no-objects checks the "
            "chains only)",
            file=sys.stderr,
        )
        return 1
    unknown = kind == "run" and results[0].status == "not_sealed" and results[0].event_count == 0
    ok = bool(results) and all(r.ok for r in results)
    if args.json:
        doc = {"kind": "unknown" if unknown else kind, "id": args.id, "ok": ok, "runs": msgspec.to_builtins(results)}
        print(json.dumps(doc))
    elif unknown:
        print(f"nothing recorded for {args.id}: no batch or run with that id")
    else:
        for result in results:
            print(result_line(result))
        print(summary_line(kind, args.id, results))
    return 0 if ok else 1
