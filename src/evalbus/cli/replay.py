"""`evalbus replay [--from-stream]`: rebuild the read models (batches, runs) from the event store.

With `--from-stream` the whole CASES stream is first recorded again from sequence 1 into the
event store, exactly as the gateway's recorder does it (`store.record`: sequences already stored
are skipped, so this is idempotent and safe while the gateway runs), then the read models are
rebuilt. That recovers an event store that lost events, or fills an empty database from the bus
(the schema is migrated first).

Seals are not derived data: runs sealed before stay sealed as they were, and runs the re-recording
completes are sealed as the recorder would seal them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import asyncpg
import nats
import nats.errors
from nats.js import api as jsapi

from evalbus.cli.connection import TargetError, add_database_options, database_url, nats_url
from evalbus_contracts import DecodeError, decode_event
from evalbus_contracts.streams import CASES

# The event store is the gateway's: imported when the command runs, so that `evalbus.cli`, which
# registers every command, imports no service.
if TYPE_CHECKING:
    from evalbus_gateway.store import RebuildOutcome, RecordOutcome
    from evalbus_gateway.store.connections import Database

CHUNK = 1000
"""Messages recorded per transaction."""
IDLE_TIMEOUT_S = 10.0
"""Give up reading the stream when no message comes for this long."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `replay` parser."""
    parser = commands.add_parser(
        "replay",
        help="rebuild the read models from the event store (--from-stream: from the bus)",
        description="Rebuild the read models (batches, runs) from the event store. With --from-stream, first "
        "record the whole CASES stream from sequence 1 into the event store (idempotent: sequences already "
        "recorded are skipped).",
    )
    parser.add_argument(
        "--from-stream", action="store_true", help="re-record the CASES stream into the event store first"
    )
    parser.add_argument(
        "--nats", default=None, help="NATS URL (default: the one `evalbus up` recorded, else $NATS_URL)"
    )
    add_database_options(parser)
    parser.set_defaults(run=run)


@dataclass
class StreamReplay:
    """What re-recording the stream did."""

    read: int = 0
    """Messages read from the stream."""
    first_seq: int | None = None
    """First sequence read."""
    last_seq: int | None = None
    """Last sequence read."""
    undecodable: int = 0
    """Messages that are not events of this version (left out)."""
    outcomes: list[RecordOutcome] = field(default_factory=list)
    """One per recorded chunk."""

    def total(self, name: str) -> int:
        """A `RecordOutcome` counter summed over the chunks."""
        return sum(int(getattr(o, name)) for o in self.outcomes)

    def unfinalized(self) -> set[str]:
        """Complete batches the recording found without `batch.finalized` (the gateway finalizes them)."""
        return {b for o in self.outcomes for b in o.complete_batches}


async def record_stream(
    db: Database, server: str, *, chunk: int = CHUNK, say: Callable[[str], None] = lambda _: None
) -> StreamReplay:
    """Record every message of CASES (from sequence 1 up to the last one when it started) into the event store."""
    from evalbus_gateway.store import RecordedMessage, record

    servers = [u.strip() for u in server.split(",") if u.strip()]
    nc = await nats.connect(servers=servers, name="evalbus-replay", connect_timeout=5, max_reconnect_attempts=3)
    out = StreamReplay()
    try:
        js = nc.jetstream()
        info = await js.stream_info(CASES.name)
        last = int(info.state.last_seq or 0)
        if not info.state.messages:
            return out
        config = jsapi.ConsumerConfig(filter_subjects=list(CASES.subjects), deliver_policy=jsapi.DeliverPolicy.ALL)
        sub = await js.subscribe(CASES.subjects[0], stream=CASES.name, ordered_consumer=True, config=config)
        pending: list[RecordedMessage] = []
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=IDLE_TIMEOUT_S)
                except nats.errors.TimeoutError:
                    say(f"no message for {IDLE_TIMEOUT_S:.0f} s before sequence {last}: stopping there")
                    break
                seq = int(msg.metadata.sequence.stream)
                out.read += 1
                out.first_seq = seq if out.first_seq is None else out.first_seq
                out.last_seq = seq
                try:
                    pending.append(RecordedMessage(seq, msg.subject, msg.data, decode_event(msg.data)))
                except DecodeError:
                    out.undecodable += 1
                if len(pending) >= chunk:
                    out.outcomes.append(await record(db, pending))
                    pending = []
                if seq >= last or msg.metadata.num_pending == 0:
                    break
            if pending:
                out.outcomes.append(await record(db, pending))
        finally:
            await sub.unsubscribe()
    finally:
        await nc.close()
    return out


async def replay(database: str, server: str | None, say: Callable[[str], None]) -> RebuildOutcome:
    """Re-record the stream (when `server` is given), then rebuild the read models; prints counts."""
    from evalbus_gateway.store import migrate, rebuild_read_models

    conn = await asyncpg.connect(database)
    try:
        if server is not None:
            await migrate(conn)
            say(f"recording the CASES stream of {server} into the event store…")
            done = await record_stream(conn, server, say=say)
            span = f" (sequences {done.first_seq}..{done.last_seq})" if done.read else ""
            say(
                f"stream: {done.read} messages read{span}: {done.total('inserted')} recorded, "
                f"{done.total('already_recorded')} already recorded, {done.total('duplicates')} duplicates, "
                f"{done.total('rejected_sealed')} refused (run sealed), {done.total('invalid')} invalid, "
                f"{done.undecodable} undecodable; {len({r for o in done.outcomes for r in o.sealed_runs})} runs sealed"
            )
            waiting = done.unfinalized()
            if waiting:
                say(f"{len(waiting)} complete batches have no batch.finalized yet: the gateway finalizes them")
        outcome = await rebuild_read_models(conn)
        batches = await conn.fetchval("SELECT count(*) FROM batches")
        runs = await conn.fetchval("SELECT count(*) FROM runs")
        sealed = await conn.fetchval("SELECT count(*) FROM runs WHERE sealed")
        say(
            f"read models rebuilt from {outcome.events} events ({outcome.undecodable} undecodable): "
            f"{batches} batches, {runs} runs ({sealed} sealed)"
        )
        return outcome
    finally:
        await conn.close()


def run(args: argparse.Namespace) -> int:
    """Replay; 0 when the read models were rebuilt."""
    try:
        database = database_url(args.dir, args.database)
        server = nats_url(args.dir, args.nats) if args.from_stream else None
        asyncio.run(replay(database, server, say=lambda line: print(line, flush=True)))
    except TargetError as e:
        print(f"evalbus replay: {e}", file=sys.stderr)
        return 1
    except (OSError, asyncpg.PostgresError, nats.errors.Error) as e:
        print(f"evalbus replay failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0
