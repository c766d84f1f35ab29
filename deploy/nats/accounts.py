"""Renders `accounts.conf` beside this file from evalbus's table of NATS users
(`evalbus.infra.nats_accounts`, where the table and its derivation live; `evalbus up --secure`
uses the same table for the local stack).

    python deploy/nats/accounts.py            # rewrite deploy/nats/accounts.conf
    python deploy/nats/accounts.py --check    # exit 1 when the committed file is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import evalbus.infra.nats_accounts as _table
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    import evalbus.infra.nats_accounts as _table

from evalbus.infra.nats_accounts import *  # noqa: F403 - this file is the table's deploy-side face

__all__ = [name for name in dir(_table) if not name.startswith("_")]

if __name__ == "__main__":
    raise SystemExit(_table.main(Path(__file__).with_name("accounts.conf")))
