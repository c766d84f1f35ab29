"""`evalbus up`: start nats-server, PostgreSQL and the five services, and wait until all are healthy."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

from evalbus.cli.options import add_dir_option
from evalbus.infra.endpoints import Endpoints, redact_url
from evalbus.infra.stack import UnhealthyError, UpError, UpOptions, bring_up, log_tail


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `up` parser."""
    parser = commands.add_parser(
        "up",
        help="start the local stack (idempotent)",
        description="Start nats-server (JetStream), PostgreSQL (DATABASE_URL, else embedded), apply "
        "migrations, start the five services, and wait until every component is healthy.",
    )
    add_dir_option(parser, search_parents=False)  # a stack of this folder, not a parent's
    parser.add_argument("--no-services", action="store_true", help="start only nats-server and PostgreSQL")
    parser.add_argument(
        "--nats-port", type=int, default=None, help="fixed NATS client port (default: the last one, else a free one)"
    )
    parser.add_argument(
        "--database",
        default=None,
        help="database created on the DATABASE_URL server (default: the one this stack used before, else evalbus; "
        "when that is another stack's event store, one of this stack's own)",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for health (default: 60)")
    parser.add_argument(
        "--secure",
        action="store_true",
        help="NATS with the deployments' least-privilege users: each service its own, the CLI admin "
        "(passwords in DIR/nats/users.json, mode 0600)",
    )
    parser.set_defaults(run=run)


def _print_endpoints(endpoints: Endpoints) -> None:
    print(
        f"  nats       {endpoints.nats}"
        + ("  (least-privilege users: " + endpoints.nats_users + ")" if endpoints.nats_users else "")
    )
    if endpoints.gateway:
        print(f"  gateway    {endpoints.gateway}")
    if endpoints.database:
        print(f"  database   {redact_url(endpoints.database)} ({endpoints.postgres})")
    for name, svc in endpoints.services.items():
        print(f"  {name:<10} {svc.metrics}")
    if endpoints.token_file:
        print(f"  token      {endpoints.token_file}")


def _fail(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _indented_tail(path: Path) -> str:
    tail = log_tail(path)
    return textwrap.indent(tail, "    | ") if tail else "    (no log output)"


def run(args: argparse.Namespace) -> int:
    """Bring the stack up; 0 when everything is healthy."""
    opts = UpOptions(
        state_dir=args.dir,
        services=not args.no_services,
        nats_port=args.nats_port,
        database_url=os.environ.get("DATABASE_URL") or None,
        database_name=args.database,
        timeout_s=args.timeout,
        secure=args.secure,
    )
    try:
        result = bring_up(opts, say=lambda line: print(f"  {line}", flush=True))
    except UpError as e:
        _fail(f"evalbus up failed: {e.component}: {e.message}")
        if e.log is not None:
            _fail(f"  last lines of {e.log}:\n{_indented_tail(e.log)}")
        if e.started:
            _fail("Stop what did start with `evalbus down`.")
        return 1
    except UnhealthyError as e:
        _fail("evalbus up failed, not healthy:")
        for c in e.health.unhealthy():
            _fail(f"  {c.name}: {c.detail}")
            log = e.logs.get(c.name)
            if log is not None:
                _fail(f"  last lines of {log}:\n{_indented_tail(log)}")
        _fail("Stop what did start with `evalbus down`.")
        return 1
    if not result.started:
        print(f"evalbus is already up ({args.dir}):")
    else:
        print(f"evalbus is up ({args.dir}):")
    _print_endpoints(result.endpoints)
    return 0
