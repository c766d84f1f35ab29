"""Fixtures for dispatcher tests: harness scripts written to tmp, case requests, a local backend
with its own secret store, and a recording live sink."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from evalbus_contracts import (
    CasePlan,
    CaseRequested,
    CaseSpec,
    CommandHarness,
    GraderSpec,
    Infra,
    PlacementSample,
    TraceEvent,
    TraceSpec,
    batch_run_id,
)
from evalbus_dispatcher import LiveSink, LocalBackend, OutputStream
from evalbus_runtime.secrets import SecretStore

SECRET_VALUE = "s3cr3t-VALUE-9f2c7e1d"
"""The value behind the secret name `api-key` in the test secret store."""

LiveRecord = tuple[str, Any]
"""("log", (stream, text)) | ("trace", [events]) | ("infra", mark) | ("placement", sample)."""


class _RecordingLive:
    def __init__(self, records: list[LiveRecord]) -> None:
        self.records = records

    async def log(self, stream: OutputStream, text: str) -> None:
        self.records.append(("log", (stream, text)))

    async def trace(self, events: Sequence[TraceEvent]) -> None:
        self.records.append(("trace", list(events)))

    async def infra(self, marks: Sequence[Infra]) -> None:
        self.records.extend(("infra", mark) for mark in marks)

    async def placement(self, sample: PlacementSample) -> None:
        self.records.append(("placement", sample))


@pytest.fixture
def live_records() -> list[LiveRecord]:
    """What the `live` sink received, in order."""
    return []


@pytest.fixture
def live(live_records: list[LiveRecord]) -> LiveSink:
    """A live sink that records every call."""
    return _RecordingLive(live_records)


@pytest.fixture
def script(tmp_path: Path) -> Callable[[str], tuple[str, ...]]:
    """Write a Python harness to tmp and return its argv."""
    counter = iter(range(1000))

    def write(code: str) -> tuple[str, ...]:
        path = tmp_path / f"harness_{next(counter)}.py"
        path.write_text(textwrap.dedent(code))
        return (sys.executable, str(path))

    return write


@pytest.fixture
def secrets_dir(tmp_path: Path) -> Path:
    """A secrets directory holding `db-pass`."""
    directory = tmp_path / "secrets"
    directory.mkdir()
    (directory / "db-pass").write_text("from-a-file\n")
    return directory


@pytest.fixture
def sandbox_root(tmp_path: Path) -> Path:
    """Where the backend creates workdirs."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    return root


@pytest.fixture
def make_backend(sandbox_root: Path, secrets_dir: Path) -> Callable[..., LocalBackend]:
    """Local backends whose dispatcher environment holds a secret and service settings (keyword
    arguments override the test defaults)."""
    environ = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(sandbox_root),
        "EVALBUS_SECRET_API_KEY": SECRET_VALUE,
        "NATS_URL": "nats://127.0.0.1:1",
    }

    def make(**overrides: Any) -> LocalBackend:
        settings: dict[str, Any] = {
            "slots": 2,
            "root": sandbox_root,
            "secrets": SecretStore(environ, secrets_dir),
            "environ": environ,
            "kill_grace_s": 0.5,
            "drain_s": 1.0,
        }
        return LocalBackend(**(settings | overrides))

    return make


@pytest.fixture
def backend(make_backend: Callable[..., LocalBackend]) -> LocalBackend:
    """A local backend whose dispatcher environment holds a secret and service settings."""
    return make_backend()


@pytest.fixture
def make_request(request: pytest.FixtureRequest) -> Callable[..., CaseRequested]:
    """Build a case request with ids of the test's own."""
    batch = "b-" + request.node.name.replace("[", "-").replace("]", "")[-40:]

    def make(
        command: tuple[str, ...],
        *,
        case_id: str = "c1",
        input: str = "What is 6 x 7?",
        expected: str | None = None,
        graders: tuple[GraderSpec, ...] = (),
        trial: int | None = None,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        secret_env: dict[str, str] | None = None,
        files: dict[str, str] | None = None,
        trace: TraceSpec | None = None,
        attempt: int = 1,
    ) -> CaseRequested:
        return CaseRequested(
            batch_id=batch,
            case_id=case_id,
            run_id=batch_run_id(batch, case_id, trial),
            attempt=attempt,
            trial=trial,
            case=CaseSpec(id=case_id, input=input, expected=expected, graders=graders, timeout_s=timeout_s),
            harness=CommandHarness(
                id="agent",
                version="7",
                command=command,
                env=env or {},
                secret_env=secret_env or {},
                files=files or {},
                trace=trace or TraceSpec(),
            ),
            plan=CasePlan(suite_id="suite", submitted_by="alice", trials=2 if trial else 1),
        )

    return make
