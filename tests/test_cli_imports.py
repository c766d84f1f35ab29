"""The CLI and the Python SDK speak to the gateway only over HTTP: they import the HTTP contract
from the `evalbus_api` library and no service package.

Every module of `evalbus.cli` and `evalbus.client` is imported in a fresh interpreter, one after the
other, and each is charged with the service modules that importing it added to `sys.modules`.

Two operator commands are left out of the list: `evalbus replay` and `evalbus verify` work on the
event store itself (they re-record the CASES stream into it, rebuild its read models, recompute its
seals) and so use the gateway's `evalbus_gateway.store`. They import it only when they run, though:
`evalbus.cli`, which every module here imports first, registers them, so their module-level imports
are checked all the same.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import evalbus.cli

pytestmark = pytest.mark.unit

SERVICES = ("evalbus_gateway", "evalbus_dispatcher", "evalbus_judge", "evalbus_exporter", "evalbus_collector")
"""Top-level packages of the five services."""
OPERATOR_COMMANDS = ("evalbus.cli.replay", "evalbus.cli.verify")
"""Commands that may use the gateway's event store (see the module docstring)."""


def cli_modules() -> list[str]:
    """`evalbus.client` and every module of `evalbus.cli` but the operator commands (and `__main__`,
    which runs the CLI: it imports `evalbus.cli` only)."""
    folder = Path(evalbus.cli.__file__).parent
    found = [f"evalbus.cli.{m.name}" for m in pkgutil.iter_modules([str(folder)]) if m.name != "__main__"]
    return ["evalbus.cli", "evalbus.client", *sorted(m for m in found if m not in OPERATOR_COMMANDS)]


CHARGE = """
import importlib, json, sys
services = tuple(sys.argv[1].split(","))
def loaded():
    return {m for m in sys.modules if m.split(".")[0] in services}
charged = {}
for name in sys.argv[2:]:
    before = loaded()
    importlib.import_module(name)
    charged[name] = sorted(loaded() - before)
print(json.dumps(charged))
"""


def test_the_modules_are_found() -> None:
    """The list is read from the package, so a new command is checked without editing this test."""
    modules = cli_modules()
    assert {"evalbus.cli.run", "evalbus.cli.tail", "evalbus.cli.suite_file", "evalbus.client"} <= set(modules)
    assert not set(OPERATOR_COMMANDS) & set(modules)


def test_the_cli_and_the_sdk_import_no_service() -> None:
    modules = cli_modules()
    done = subprocess.run(
        [sys.executable, "-c", CHARGE, ",".join(SERVICES), *modules],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    charged: dict[str, list[str]] = json.loads(done.stdout)
    assert sorted(charged) == sorted(modules)
    assert {name: pulled for name, pulled in charged.items() if pulled} == {}
