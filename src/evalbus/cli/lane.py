"""`evalbus lane credential LANE`: a NATS user scoped to one lane, for a dispatcher that joins over
the bus from a machine of its own (a GPU box, a laptop) and takes only that lane's cases.

On the local secure stack it adds the user (nats-server reloads, nothing restarts) and prints the
dispatcher's environment; with `--conf` it prints the user's permissions for a deployment's
`accounts.conf` instead (docs/backends.md, "Lanes")."""

from __future__ import annotations

import argparse
import shlex
import sys

from evalbus.cli.options import add_dir_option
from evalbus.infra import nats_accounts
from evalbus.infra.lanes import LaneCredentialError, lane_credential
from evalbus.infra.stack import new_nats_password
from evalbus_contracts import lane_problem


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `lane` parser."""
    parser = commands.add_parser(
        "lane",
        help="lanes: credentials for dispatchers that serve one lane",
        description="Lanes route cases to the dispatchers serving them (harness.lane, DISPATCHER_LANES).",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    credential = verbs.add_parser(
        "credential",
        help="a NATS user that may take only LANE's cases",
        description="Give LANE's dispatchers a NATS user of their own: it may create, pull and acknowledge only "
        "the lane's consumer (dispatcher-cases-LANE, its filter pinned) and publish what a dispatcher produces; "
        "another lane's queue, a batch or a stream's definition is refused by the server. On the local "
        "`evalbus up --secure` stack the user is added at once and the dispatcher's environment is printed "
        "(KEY=value lines: redirect them to a file of mode 0600).",
    )
    credential.add_argument("lane", help="the lane (e.g. gpu, nomad-eu)")
    add_dir_option(credential)
    credential.add_argument(
        "--conf",
        action="store_true",
        help="print the permissions and the user entry to add to a deployment's accounts.conf (the password from "
        "$NATS_PASSWORD_LANE_<LANE>) instead of touching the local stack",
    )
    credential.set_defaults(run=run_credential)


def run_credential(args: argparse.Namespace) -> int:
    """Print the lane's credential (or its accounts.conf entry); 2 on a bad lane or no secure stack."""
    lane: str = args.lane
    problem = lane_problem(lane)
    if problem is not None:
        print(f"evalbus lane credential: {lane!r} is not a lane name: {problem}", file=sys.stderr)
        return 2
    if args.conf:
        print("# the lane's permissions, beside the others in accounts.conf:")
        print("\n".join(nats_accounts.render_lane_permissions(lane)))
        print("# and its user, in the EVALBUS account's `users` list:")
        print(nats_accounts.render_lane_user(lane))
        return 0
    try:
        credential = lane_credential(args.dir, lane, new_nats_password())
    except LaneCredentialError as e:
        print(f"evalbus lane credential: {e}", file=sys.stderr)
        return 2
    print(
        f"# lane {lane}: NATS user {credential.user}. Run a dispatcher with this environment where the lane's "
        "cases should run\n# (python -m evalbus_dispatcher); it takes only cases whose harness or case says "
        f"lane: {lane}.",
        file=sys.stderr,
    )
    for key, value in credential.environment().items():
        print(f"{key}={shlex.quote(value)}")
    return 0
