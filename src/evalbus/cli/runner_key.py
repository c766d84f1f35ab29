"""`evalbus runner-key`: a new key pair for the runners' credential check (nats-server's auth
callout): its public key for the NATS servers (`NATS_RUNNER_ISSUER`), its seed for the dispatchers
(`DISPATCHER_RUNNER_AUTH_SEED`), printed as `KEY=value` lines (docs/deploy.md, "Run tokens").

`--public` reads a seed on stdin and prints its public key (to check which servers and
dispatchers belong together). The local `evalbus up --secure` stack makes its own pair."""

from __future__ import annotations

import argparse
import sys

from evalbus.infra import nats_accounts
from evalbus_runtime.nkeys import AccountKey

SEED_VARIABLE = "DISPATCHER_RUNNER_AUTH_SEED"
"""Where a dispatcher reads the seed from (`DispatcherSettings.runner_auth_seed`)."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `runner-key` parser."""
    parser = commands.add_parser(
        "runner-key",
        help="a key pair for the runners' run tokens (NATS auth callout)",
        description="Print a new account key pair as KEY=value lines: NATS_RUNNER_ISSUER (the public key, for the "
        "NATS servers' environment) and DISPATCHER_RUNNER_AUTH_SEED (the seed, for the dispatchers only: whoever "
        "holds it can let any client publish any run's live view). Redirect to a file of mode 0600.",
    )
    parser.add_argument("--public", action="store_true", help="read a seed (SA...) on stdin, print its public key")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the pair (or the public key of the seed on stdin); 2 for a seed that is none."""
    if args.public:
        try:
            key = AccountKey.from_seed(sys.stdin.read())
        except ValueError as e:
            print(f"evalbus runner-key --public: {e}", file=sys.stderr)
            return 2
        print(f"{nats_accounts.ISSUER_VARIABLE}={key.public}")
        return 0
    key = AccountKey.generate()
    print(f"# the public key, for the NATS servers ({nats_accounts.ISSUER_VARIABLE} in accounts.conf):")
    print(f"{nats_accounts.ISSUER_VARIABLE}={key.public}")
    print("# the seed, for the dispatchers only (with DISPATCHER_RUNNER_AUTH_URL, the runner-auth user's URL):")
    print(f"{SEED_VARIABLE}={key.seed}")
    return 0
