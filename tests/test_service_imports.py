"""A service's start imports only what it uses: the gateway does not load the MCP SDK until a
request to `/mcp` (its imports took 1.5 s of a 2.3 s start on two cores), and a dispatcher on the
local backend does not load the Kubernetes client, Nomad or Docker (0.7 s of 1.3 s). Every e2e
test, `evalbus up` and a rolling restart wait for these starts.

Each entry point is imported in a fresh interpreter and the heavy modules it pulled in are named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
heavy = sys.argv[2].split(",")
print(json.dumps(sorted(m for m in sys.modules if m in heavy or any(m.startswith(h + ".") for h in heavy))))
"""


def loaded_by(entry_point: str, heavy: tuple[str, ...]) -> list[str]:
    """The modules of `heavy` (and their submodules) importing `entry_point` loads."""
    out = subprocess.run(  # noqa: S603 - our own interpreter and probe
        [sys.executable, "-c", PROBE, entry_point, ",".join(heavy)], capture_output=True, text=True, check=True
    )
    return list(json.loads(out.stdout))


def test_the_gateway_starts_without_the_mcp_sdk() -> None:
    assert loaded_by("evalbus_gateway.__main__", ("mcp", "mcp_types", "evalbus_gateway.api.mcp_server")) == []


def test_a_local_dispatcher_starts_without_the_cluster_backends() -> None:
    cluster = (
        "kubernetes",
        "evalbus_dispatcher.backends.kubernetes",
        "evalbus_dispatcher.backends.nomad",
        "evalbus_dispatcher.backends.docker",
    )
    assert loaded_by("evalbus_dispatcher.__main__", cluster) == []


def test_the_probe_sees_a_heavy_import() -> None:
    """The probe can fail: importing the SDK's side of `/mcp` loads the SDK."""
    assert "mcp" in loaded_by("evalbus_gateway.api.mcp_server", ("mcp",))
