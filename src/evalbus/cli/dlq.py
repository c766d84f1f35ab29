"""`evalbus dlq …`: the dead letters of every service, read from the `DLQ` stream.

    evalbus dlq ls [--service NAME] [--json]     one line per letter: seq, service, subject, reason
    evalbus dlq show SEQ [--json]                a letter whole: reason, original subject, payload
    evalbus dlq redrive SEQ… | --all [--service NAME]

A letter is a message a service could not handle (poison, or `max_deliver` exhausted), copied to
`dlq.<service>` with the reason before the original was terminated. `redrive` publishes the
original message again on its original subject (read from its stream while the stream has it; a
letter of a message too big to copy whole holds only its head), with its original headers except
`Nats-Msg-Id`,
which becomes `<original id>:redrive:<letter seq>` — so the stream does not drop it as a duplicate
of the original, and redriving the same letter twice (within the duplicate window) stores it once.
The letter stays in the DLQ as the record of what happened. Exit codes: 0 done, 1 the bus failed or
a letter is unknown, 2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass

import nats
import nats.errors
from nats.aio.client import Client as NatsClient

from evalbus.cli.connection import TargetError, nats_url
from evalbus.cli.options import add_dir_option
from evalbus_contracts import DeadLetter, DecodeError, decode_event, encode_token, to_builtins
from evalbus_contracts.streams import DLQ

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


@dataclass(frozen=True, slots=True)
class StoredLetter:
    """A dead letter and its sequence in the DLQ stream."""

    seq: int
    letter: DeadLetter


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `dlq` parser and its subcommands."""
    parser = commands.add_parser("dlq", help="dead letters: list, show, redrive", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="dlq_command", required=True, metavar="SUBCOMMAND")
    ls = sub.add_parser("ls", help="one line per dead letter")
    ls.add_argument("--service", default=None, help="only this service's letters")
    show = sub.add_parser("show", help="a dead letter whole")
    show.add_argument("seq", type=int)
    redrive = sub.add_parser("redrive", help="publish the original messages again")
    redrive.add_argument("seqs", type=int, nargs="*", metavar="SEQ")
    redrive.add_argument("--all", action="store_true", help="every letter (of --service, when given)")
    redrive.add_argument("--service", default=None)
    for each in (ls, show, redrive):
        each.add_argument("--json", action="store_true", help="print JSON")
        each.add_argument(
            "--nats", default=None, help="NATS URL (default: the one `evalbus up` recorded, else $NATS_URL)"
        )
        add_dir_option(each)
        each.set_defaults(run=run)


async def read_letters(nc: NatsClient, service: str | None = None) -> list[StoredLetter]:
    """Every dead letter stored (of one service), in stream order."""
    js = nc.jetstream()
    subject = f"dlq.{encode_token(service)}" if service else "dlq.>"
    info = await js.stream_info(DLQ.name, subjects_filter=subject)
    total = sum((info.state.subjects or {}).values())
    out: list[StoredLetter] = []
    if total == 0:
        return out
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        while len(out) < total:
            msg = await sub.next_msg(timeout=5)
            try:
                event = decode_event(msg.data)
            except (DecodeError, ValueError):
                continue
            if isinstance(event, DeadLetter):
                out.append(StoredLetter(seq=msg.metadata.sequence.stream, letter=event))
    except nats.errors.TimeoutError:
        pass
    finally:
        await sub.unsubscribe()
    return out


async def original_bytes(nc: NatsClient, letter: DeadLetter) -> bytes | None:
    """The original message's bytes, read from its stream while the stream still holds it (a letter
    carries only the head of a message too big to copy whole, and non-UTF-8 bytes replaced)."""
    if letter.stream is None or letter.stream_seq is None:
        return None
    try:
        msg = await nc.jetstream().get_msg(letter.stream, letter.stream_seq)
    except nats.errors.Error:
        return None
    return msg.data if msg.subject == letter.subject_ and msg.data is not None else None


async def redrive_letter(nc: NatsClient, stored: StoredLetter) -> int:
    """Publish a letter's original message again — the stream's copy when it still has it, else the
    letter's — and return the stream sequence it was stored at."""
    letter = stored.letter
    if not letter.subject_:
        raise ValueError(f"letter {stored.seq} has no original subject")
    payload = await original_bytes(nc, letter)
    if payload is None:
        if letter.payload_cut():
            raise ValueError(
                f"letter {stored.seq} holds only the head of its message, and {letter.stream} no longer has the "
                f"original at seq {letter.stream_seq}: nothing whole to redrive"
            )
        payload = letter.payload.encode("utf-8")
    headers = dict(letter.headers)
    original = headers.get("Nats-Msg-Id") or f"dlq:{letter.service}:{letter.stream}:{letter.stream_seq}"
    headers["Nats-Msg-Id"] = f"{original}:redrive:{stored.seq}"
    ack = await nc.jetstream().publish(letter.subject_, payload, headers=headers)
    return int(ack.seq)


def _line(stored: StoredLetter) -> str:
    letter = stored.letter
    return f"{stored.seq:>6}  {letter.service:<10} {letter.subject_ or '-':<48} {letter.reason}"


async def _run(args: argparse.Namespace, server: str) -> int:
    nc = await nats.connect(servers=[server], name="evalbus-dlq", connect_timeout=5, max_reconnect_attempts=3)
    try:
        command = args.dlq_command
        if command == "ls":
            letters = await read_letters(nc, args.service)
            if args.json:
                print(json.dumps([{"seq": s.seq, **to_builtins(s.letter)} for s in letters], default=str))
            elif not letters:
                print("no dead letter")
            else:
                print(f"{'SEQ':>6}  {'SERVICE':<10} {'SUBJECT':<48} REASON")
                for stored in letters:
                    print(_line(stored))
            return EXIT_OK
        letters = await read_letters(nc, getattr(args, "service", None))
        by_seq = {s.seq: s for s in letters}
        if command == "show":
            found = by_seq.get(args.seq)
            if found is None:
                print(f"evalbus dlq show: no dead letter at sequence {args.seq}", file=sys.stderr)
                return EXIT_FAILED
            doc = {"seq": found.seq, **to_builtins(found.letter)}
            print(json.dumps(doc, indent=None if args.json else 2, default=str))
            return EXIT_OK
        if args.all == bool(args.seqs):
            print("evalbus dlq redrive: name letters by SEQ, or --all (not both)", file=sys.stderr)
            return EXIT_BAD_INPUT
        if args.all:
            chosen = letters
        else:
            missing = [seq for seq in args.seqs if seq not in by_seq]
            if missing:
                print(
                    f"evalbus dlq redrive: no dead letter at sequence {', '.join(map(str, missing))}", file=sys.stderr
                )
                return EXIT_FAILED
            chosen = [by_seq[seq] for seq in args.seqs]
        for stored in chosen:
            seq = await redrive_letter(nc, stored)
            if args.json:
                print(json.dumps({"letter": stored.seq, "subject": stored.letter.subject_, "stream_seq": seq}))
            else:
                target = f"{stored.letter.stream} seq {seq}"
                print(f"letter {stored.seq} redriven to {stored.letter.subject_} (stored at {target})")
        return EXIT_OK
    finally:
        await nc.close()


def run(args: argparse.Namespace) -> int:
    """Run one `dlq` subcommand; the exit code."""
    try:
        server = nats_url(args.dir, args.nats)
    except TargetError as e:
        print(f"evalbus dlq: {e}", file=sys.stderr)
        return EXIT_FAILED
    try:
        return asyncio.run(_run(args, server))
    except (OSError, nats.errors.Error, ValueError) as e:
        print(f"evalbus dlq {args.dlq_command}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
