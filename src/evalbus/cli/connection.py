"""Where the commands that talk to a running stack find it: flags first, then the environment,
then what `evalbus up` recorded in the state folder.

| what | flag | environment | recorded |
|---|---|---|---|
| gateway URL | `--gateway` | `EVALBUS_GATEWAY_URL` | `endpoints.json` `gateway` |
| bearer token | `--token` | `EVALBUS_TOKEN` | the file `endpoints.json` `token_file` names (`<dir>/token`) |
| database URL | `--database` | — | `endpoints.json` `database`, else `DATABASE_URL` |
| NATS URL | `--nats` | — | `endpoints.json` `nats`, else `NATS_URL` |

The database comes from `endpoints.json` before `DATABASE_URL` because `up` creates its own
database (`evalbus`, or one of its own) on the server `DATABASE_URL` names.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from evalbus.cli.options import add_dir_option
from evalbus.infra.endpoints import Endpoints, endpoints_path, load_endpoints
from evalbus.infra.stack import nats_url_as

GATEWAY_ENV = "EVALBUS_GATEWAY_URL"
"""Gateway URL when `--gateway` is not given."""
TOKEN_ENV = "EVALBUS_TOKEN"  # noqa: S105 - the variable's name, not a token
"""Bearer token when `--token` is not given."""


class TargetError(Exception):
    """The stack (or the part of it a command needs) cannot be found."""


@dataclass(frozen=True, slots=True)
class GatewayTarget:
    """A gateway and the token to call it with."""

    url: str
    """Base URL."""
    token: str | None
    """Bearer token (None: calls are 401)."""


def add_gateway_options(parser: argparse.ArgumentParser) -> None:
    """`--gateway`, `--token` and `--dir`."""
    add_dir_option(parser)
    parser.add_argument(
        "--gateway", default=None, help=f"gateway URL (default: ${GATEWAY_ENV}, else the one `evalbus up` recorded)"
    )
    parser.add_argument(
        "--token", default=None, help=f"bearer token (default: ${TOKEN_ENV}, else the admin token of `evalbus up`)"
    )


def add_database_options(parser: argparse.ArgumentParser) -> None:
    """`--database` and `--dir`."""
    add_dir_option(parser)
    parser.add_argument(
        "--database",
        default=None,
        help="PostgreSQL URL of the event store (default: the one `evalbus up` recorded, else $DATABASE_URL)",
    )


def _recorded(state_dir: Path) -> Endpoints | None:
    try:
        return load_endpoints(state_dir)
    except (OSError, ValueError) as e:
        raise TargetError(f"cannot read {endpoints_path(state_dir)}: {e}") from e


def _read_token(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as e:
        raise TargetError(f"cannot read the token file {path}: {e.strerror or e}") from e


def not_up(state_dir: Path) -> str:
    """Why a command found no stack, and how to point it at one (a stack started elsewhere is
    the usual reason, not a stack that is missing)."""
    return (
        f"evalbus is not up in {state_dir}: point at the folder of a running stack with --dir DIR or "
        "$EVALBUS_DIR (the `.evalbus` of the folder `evalbus up` ran in), or start one here with `evalbus up`"
    )


def gateway_target(state_dir: Path, url: str | None, token: str | None) -> GatewayTarget:
    """The gateway to call (see the module docstring for the order)."""
    endpoints = None
    url = url or os.environ.get(GATEWAY_ENV) or None
    if url is None:
        endpoints = _recorded(state_dir)
        url = endpoints.gateway if endpoints is not None else None
    if url is None:
        raise TargetError(f"no gateway: {not_up(state_dir)}; or pass --gateway / set ${GATEWAY_ENV}")
    token = token or os.environ.get(TOKEN_ENV) or None
    if token is None:
        endpoints = endpoints or _recorded(state_dir)
        token_file = endpoints.token_file if endpoints is not None else None
        if token_file is None and (state_dir / "token").is_file():
            token_file = str(state_dir / "token")
        token = _read_token(Path(token_file)) if token_file else None
    return GatewayTarget(url=url, token=token)


def database_url(state_dir: Path, explicit: str | None) -> str:
    """The event store's database URL."""
    if explicit:
        return explicit
    endpoints = _recorded(state_dir)
    if endpoints is not None and endpoints.database:
        return endpoints.database
    env = os.environ.get("DATABASE_URL")
    if env:
        return env
    raise TargetError(f"no database: {not_up(state_dir)}; or pass --database")


def nats_url(state_dir: Path, explicit: str | None) -> str:
    """The NATS server's URL."""
    if explicit:
        return explicit
    endpoints = _recorded(state_dir)
    if endpoints is not None and endpoints.nats:
        return nats_url_as(endpoints, "admin")  # with its password when the stack runs --secure
    env = os.environ.get("NATS_URL")
    if env:
        return env
    raise TargetError(f"no NATS server: {not_up(state_dir)}; or pass --nats")
