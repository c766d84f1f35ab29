"""`evalbus status [--json]`: health of nats-server, PostgreSQL and every service; exit 0 only when all
are healthy."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec

from evalbus.cli.connection import not_up
from evalbus.cli.options import add_dir_option
from evalbus.infra.endpoints import Endpoints, endpoints_path, load_endpoints
from evalbus.infra.health import ComponentHealth, StackHealth, check_stack


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `status` parser."""
    parser = commands.add_parser(
        "status",
        help="health of every component",
        description="Check nats-server (monitoring /healthz with JetStream), PostgreSQL (select 1) and each "
        "service (/healthz and /readyz). Exit code 0 only when every component is healthy.",
    )
    add_dir_option(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of a table")
    parser.set_defaults(run=run)


def render_table(health: StackHealth) -> str:
    """A fixed-width table, one component per line."""
    rows = [("COMPONENT", "STATE", "PID", "URL", "DETAIL")]
    for c in health.components:
        state = "healthy" if c.healthy else "UNHEALTHY"
        rows.append((c.name, state, str(c.pid) if c.pid is not None else "-", c.url or "-", c.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4] for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def status_document(state_dir: Path, endpoints: Endpoints | None, health: StackHealth | None) -> dict[str, Any]:
    """The `--json` document: overall health, whether `up` recorded anything running, each component by name."""
    components: dict[str, ComponentHealth] = {c.name: c for c in health.components} if health else {}
    return {
        "healthy": bool(health and health.healthy),
        "up": bool(endpoints and endpoints.processes()),
        "dir": str(state_dir),
        "components": msgspec.to_builtins(components),
    }


def run(args: argparse.Namespace) -> int:
    """Print the stack's health; 0 when every component is healthy."""
    endpoints = load_endpoints(args.dir)
    health = None
    if endpoints is not None:
        health = asyncio.run(check_stack(endpoints, services=bool(endpoints.services)))
    if args.json:
        print(json.dumps(status_document(args.dir, endpoints, health), indent=2))
    elif health is None:
        print(f"{not_up(args.dir)} (no {endpoints_path(args.dir)})")
    else:
        print(render_table(health))
        if endpoints is not None and endpoints.gateway:
            print(f"\ngateway {endpoints.gateway}   token {endpoints.token_file}")
        print(f"stack   {args.dir.resolve()}")  # the folder found, when it is one above this one
    return 0 if health is not None and health.healthy else 1
