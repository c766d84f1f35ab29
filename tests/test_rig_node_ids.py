"""The rig gives every test a node id of its own, so pytest-xdist runs them all.

schemathesis names each API operation's item `test[GET /path]`, but under pytest 9 they share the
function's node id, and xdist's `--dist loadfile` (what `just test` runs) schedules by node id:
without the rig's hook a two-worker run of an API fuzz test runs one operation and reports one
pass. These tests run small test files in a pytest of their own. Checked by hand: with the hook's
renaming and its refusal turned off, all three fail.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

FUZZ_FILE = """
import schemathesis

DOCUMENT = {
    "openapi": "3.0.3",
    "info": {"title": "t", "version": "1"},
    "paths": {
        "/a": {"get": {"responses": {"200": {"description": "ok"}}}},
        "/b": {"get": {"responses": {"200": {"description": "ok"}}}},
        "/c": {"post": {"responses": {"200": {"description": "ok"}}}},
    },
}
schema = schemathesis.openapi.from_dict(DOCUMENT)


@schema.parametrize()
def test_operation(case):
    assert case.path in ("/a", "/b", "/c")
"""

TWIN_FILE = """
import pytest


def pytest_pycollect_makeitem(collector, name, obj):
    if name == "test_twin":
        return [pytest.Function.from_parent(collector, name=name, callobj=obj) for _ in range(2)]
    return None
"""


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "evalbus.testing.rig", "-p", "no:cacheprovider", "-q", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def fuzz_folder(tmp_path: Path) -> Path:
    (tmp_path / "test_fuzz.py").write_text(FUZZ_FILE)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts =\n")
    return tmp_path


def test_each_operation_has_its_own_node_id(fuzz_folder: Path) -> None:
    done = _pytest(fuzz_folder, "--collect-only")
    assert done.returncode == 0, done.stdout + done.stderr
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids == [
        "test_fuzz.py::test_operation[GET /a]",
        "test_fuzz.py::test_operation[GET /b]",
        "test_fuzz.py::test_operation[POST /c]",
    ]


def test_two_workers_run_every_operation(fuzz_folder: Path) -> None:
    done = _pytest(fuzz_folder, "-n", "2", "--dist", "loadfile")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout, done.stdout


def test_a_remaining_shared_node_id_stops_the_session(tmp_path: Path) -> None:
    """Items the hook cannot tell apart by name (here two that share their name too) are refused,
    naming the id, rather than silently run once."""
    (tmp_path / "conftest.py").write_text(TWIN_FILE)
    (tmp_path / "test_twins.py").write_text("def test_twin():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts =\n")
    done = _pytest(tmp_path, "--collect-only")
    assert done.returncode != 0
    assert "tests share node ids" in done.stdout + done.stderr
    assert "test_twins.py::test_twin" in done.stdout + done.stderr
