"""Live trace platforms for tests: a real MLflow tracking server and a real Arize Phoenix server.

Each platform lives in a virtual environment of its own (their dependency trees are large and
pinned), created once under `<repo>/.evalbus/platforms/<name>-venv` and keyed by the pinned
version (a stamp file in the venv; a different pin rebuilds it). `uv` creates it when it is
available (on PATH or as `python -m uv`), else `python -m venv` + pip.

Servers start on free loopback ports exactly as `shared/reference/platform-notes.md` says
(MLflow: one worker, job execution and telemetry off; Phoenix: external resources and telemetry
off, a free gRPC port, output to a log file), are awaited on their health endpoint with a
deadline and stopped with SIGTERM at the end of the session. When a session needs both, both
are installed and started in parallel. An install or start failure raises, so the tests that
need the server fail (they are never skipped to hide it).

Fixtures: `mlflow_server`, `phoenix_server` (session scope), each a `PlatformServer`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from evalbus.infra.ports import free_port

MLFLOW_VERSION = "3.17.2"
"""Pinned MLflow (3.18.0 is listed on PyPI but its mlflow-skinny is not, see platform-notes)."""
PHOENIX_VERSION = "20.26.1"
"""Pinned Arize Phoenix."""
INSTALL_TIMEOUT_S = 900.0
"""Upper bound for one cold install (uv takes ~15 s, pip ~4 min on 2 cores)."""
READY_TIMEOUT_S = 180.0
"""Upper bound from launch to a healthy server (measured 15-30 s)."""


class PlatformError(RuntimeError):
    """A platform server could not be installed or started."""


@dataclass(frozen=True)
class PlatformPin:
    """What to install for one platform and which console script serves it."""

    name: str
    requirement: str
    executable: str


MLFLOW = PlatformPin("mlflow", f"mlflow=={MLFLOW_VERSION}", "mlflow")
PHOENIX = PlatformPin("phoenix", f"arize-phoenix=={PHOENIX_VERSION}", "phoenix")
PINS: dict[str, PlatformPin] = {"mlflow": MLFLOW, "phoenix": PHOENIX}


@dataclass
class PlatformServer:
    """One running platform server."""

    name: str
    url: str
    """Base URL (`http://127.0.0.1:<port>`)."""
    process: subprocess.Popen[bytes]
    log_path: Path
    data_dir: Path
    venv: Path
    install_s: float
    """Seconds spent making sure the venv exists (near 0 when cached)."""
    ready_s: float
    """Seconds from launch until the health endpoint answered."""
    grpc_port: int | None = None

    @property
    def python(self) -> Path:
        """Interpreter of the platform's venv (for client scripts that need the platform SDK)."""
        return self.venv / "bin" / "python"

    def log_tail(self, limit: int = 4000) -> str:
        """The end of the server's log, for failure messages."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server (its children exit with it); SIGKILL its group only if it hangs."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def repo_root() -> Path:
    """The repository root (this file is `<root>/src/evalbus/testing/platforms.py`)."""
    return Path(__file__).resolve().parents[3]


def platforms_dir() -> Path:
    """Where platform venvs are cached: `EVALBUS_PLATFORMS_DIR`, else `<repo>/.evalbus/platforms`."""
    env = os.environ.get("EVALBUS_PLATFORMS_DIR")
    return Path(env) if env else repo_root() / ".evalbus" / "platforms"


def _uv_command() -> list[str] | None:
    found = shutil.which("uv")
    if found:
        return [found]
    probe = subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True, check=False)
    return [sys.executable, "-m", "uv"] if probe.returncode == 0 else None


def _run(argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    with log.open("ab") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        try:
            proc = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=INSTALL_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired as e:
            raise PlatformError(f"{argv[0]} timed out after {INSTALL_TIMEOUT_S}s (log: {log})") from e
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise PlatformError(f"{' '.join(argv[:4])}… exited {proc.returncode} (log: {log}):\n{tail}")


def ensure_venv(pin: PlatformPin, base: Path | None = None) -> Path:
    """The platform's venv, created and installed if missing or built for another pin.

    A file lock serialises concurrent sessions; a stamp written last marks a complete install.
    """
    base = base or platforms_dir()
    base.mkdir(parents=True, exist_ok=True)
    venv = base / f"{pin.name}-venv"
    stamp = venv / ".evalbus-pin"
    with (base / f"{pin.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (
            stamp.is_file()
            and stamp.read_text().strip() == pin.requirement
            and (venv / "bin" / pin.executable).exists()
        ):
            return venv
        if venv.exists():
            shutil.rmtree(venv)
        log = base / f"{pin.name}-install.log"
        log.write_text("")
        python = venv / "bin" / "python"
        uv = _uv_command()
        if uv is not None:
            env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
            _run([*uv, "venv", "--python", sys.executable, str(venv)], log, env)
            _run([*uv, "pip", "install", "--python", str(python), pin.requirement], log, env)
        else:
            _run([sys.executable, "-m", "venv", str(venv)], log)
            _run([str(python), "-m", "pip", "install", "--disable-pip-version-check", pin.requirement], log)
        if not (venv / "bin" / pin.executable).exists():
            raise PlatformError(f"{pin.requirement} installed no `{pin.executable}` script (log: {log})")
        stamp.write_text(pin.requirement + "\n")
        return venv


def _get_text(url: str, timeout_s: float = 2.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - loopback http only
            return str(resp.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def wait_healthy(server: PlatformServer, path: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll `server.url + path` until it answers `OK`; raise if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise PlatformError(
                f"{server.name} exited with {server.process.returncode} before it was healthy:\n{server.log_tail()}"
            )
        body = _get_text(server.url + path)
        if body is not None and body.strip().strip('"') == "OK":
            return
        time.sleep(0.25)
    server.stop()
    raise PlatformError(f"{server.name} not healthy after {timeout_s}s:\n{server.log_tail()}")


def _launch(
    name: str, argv: list[str], env: dict[str, str], data_dir: Path, venv: Path, install_s: float, port: int
) -> PlatformServer:
    log_path = data_dir / f"{name}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=data_dir,
            start_new_session=True,
        )
    return PlatformServer(
        name=name,
        url=f"http://127.0.0.1:{port}",
        process=process,
        log_path=log_path,
        data_dir=data_dir,
        venv=venv,
        install_s=install_s,
        ready_s=0.0,
    )


def _server_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["DO_NOT_TRACK"] = "true"
    return env


def start_mlflow(data_dir: Path, base: Path | None = None) -> PlatformServer:
    """Install (if needed) and start `mlflow server` on a free loopback port; return it healthy."""
    t0 = time.monotonic()
    venv = ensure_venv(MLFLOW, base)
    install_s = time.monotonic() - t0
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = _server_env(venv)
    env.update(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", MLFLOW_DISABLE_TELEMETRY="true")
    argv = [
        str(venv / "bin" / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{data_dir / 'mlflow.db'}",
        "--default-artifact-root",
        str(data_dir / "artifacts"),
    ]
    launched = time.monotonic()
    server = _launch("mlflow", argv, env, data_dir, venv, install_s, port)
    wait_healthy(server, "/health")
    server.ready_s = time.monotonic() - launched
    return server


def start_phoenix(data_dir: Path, base: Path | None = None) -> PlatformServer:
    """Install (if needed) and start `phoenix serve` on free loopback ports; return it healthy."""
    t0 = time.monotonic()
    venv = ensure_venv(PHOENIX, base)
    install_s = time.monotonic() - t0
    data_dir.mkdir(parents=True, exist_ok=True)
    port, grpc_port = free_port(), free_port()
    env = _server_env(venv)
    env.update(
        PHOENIX_HOST="127.0.0.1",
        PHOENIX_PORT=str(port),
        PHOENIX_GRPC_PORT=str(grpc_port),
        PHOENIX_WORKING_DIR=str(data_dir),
        PHOENIX_TELEMETRY_ENABLED="false",
        PHOENIX_ALLOW_EXTERNAL_RESOURCES="false",
    )
    argv = [str(venv / "bin" / "phoenix"), "serve"]
    launched = time.monotonic()
    server = _launch("phoenix", argv, env, data_dir, venv, install_s, port)
    server.grpc_port = grpc_port
    wait_healthy(server, "/healthz")
    server.ready_s = time.monotonic() - launched
    return server


STARTERS: dict[str, Callable[[Path], PlatformServer]] = {"mlflow": start_mlflow, "phoenix": start_phoenix}


class PlatformLauncher:
    """Starts each platform at most once per session, several in parallel, and stops them all."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._pool = ThreadPoolExecutor(max_workers=len(STARTERS), thread_name_prefix="platform")
        self._futures: dict[str, Future[PlatformServer]] = {}
        self._lock = threading.Lock()

    def launch(self, *names: str) -> None:
        """Begin installing and starting these platforms (idempotent)."""
        with self._lock:
            for name in names:
                if name not in self._futures:
                    self._futures[name] = self._pool.submit(STARTERS[name], self._root / name)

    def get(self, name: str) -> PlatformServer:
        """The healthy server (launching it if nobody did); re-raises its install/start error."""
        self.launch(name)
        return self._futures[name].result(timeout=INSTALL_TIMEOUT_S + READY_TIMEOUT_S)

    def close(self) -> None:
        """Stop every server that started."""
        for future in self._futures.values():
            if future.done() and future.exception() is None:
                future.result().stop()
            elif not future.done():
                with contextlib.suppress(Exception):
                    future.result().stop()
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="session")
def platform_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlatformLauncher]:
    """The session's launcher of live platform servers."""
    launcher = PlatformLauncher(tmp_path_factory.mktemp("platforms"))
    yield launcher
    launcher.close()


def _wanted(request: pytest.FixtureRequest) -> list[str]:
    """Platforms any collected test of this session uses, so they start together."""
    wanted: set[str] = set()
    for item in request.session.items:
        names = getattr(item, "fixturenames", ())
        wanted.update(name for name in STARTERS if f"{name}_server" in names)
    return sorted(wanted)


@pytest.fixture(scope="session")
def mlflow_server(platform_launcher: PlatformLauncher, request: pytest.FixtureRequest) -> PlatformServer:
    """A live MLflow tracking server (sqlite store) on a free loopback port, for the session."""
    platform_launcher.launch(*_wanted(request))
    return platform_launcher.get("mlflow")


@pytest.fixture(scope="session")
def phoenix_server(platform_launcher: PlatformLauncher, request: pytest.FixtureRequest) -> PlatformServer:
    """A live Arize Phoenix server on free loopback ports (HTTP and gRPC), for the session."""
    platform_launcher.launch(*_wanted(request))
    return platform_launcher.get("phoenix")


__all__ = [
    "MLFLOW_VERSION",
    "PHOENIX_VERSION",
    "PlatformError",
    "PlatformLauncher",
    "PlatformServer",
    "ensure_venv",
    "mlflow_server",
    "phoenix_server",
    "platform_launcher",
    "start_mlflow",
    "start_phoenix",
]
