"""The case container as the Docker engine is told it, and the engine's answers read back (pure):
the `ContainerCreateRequest` of a case attempt, image references, the fit against `/info`, a
container's inspect and event feed as a placement, its stats as usage, and secret masking of what is
read back. Used by the Docker backend (`docker.py`)."""

from __future__ import annotations

import secrets as token
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec

from evalbus_contracts import CaseRequested
from evalbus_contracts.runner import JOB_ENV, RunnerLive
from evalbus_contracts.specs import ComputeSpec
from evalbus_dispatcher.backends.base import OrchestratorEvent, UnitPlacement, UnitUsage
from evalbus_dispatcher.backends.job_spec import RunnerNats, label_value, runner_job
from evalbus_dispatcher.errors import BackendError
from evalbus_runtime.secrets import SecretStore

WORKING_DIR = "/evalbus"
"""The container's working directory; the runner's workdir is `work` under it."""
RUN_LABEL = "dev.evalbus.run"
"""Label holding the run id (exactly: Docker label values are free text)."""
MANAGED_LABEL = "dev.evalbus.managed-by"
LIFECYCLE = frozenset({"create", "start", "oom", "die", "kill", "stop", "destroy", "pause", "unpause", "restart"})
"""Container event actions marked in the run's trace (exec events are not: they carry commands)."""
REDACTED = "[redacted]"
_MIB = 1024 * 1024
SHELL = ["/bin/sh", "-c", "cd work 2>/dev/null; exec /bin/sh -i"]
"""The terminal's command: an interactive shell in the runner's workdir."""


@dataclass(frozen=True, slots=True)
class DockerTemplate:
    """What every case container of a dispatcher shares."""

    image: str
    """Image when the harness names none."""
    runner_command: tuple[str, ...] = ("python", "-m", "evalbus.runner")
    """The runner's argv in the image."""
    network: str = "bridge"
    """`HostConfig.NetworkMode`: `bridge`, `none` (no network), `host`, or a network's name."""
    start_timeout_s: float = 600.0
    """How long pulling the image and starting the container may take before the run fails."""
    gpu_driver: str = "nvidia"
    """`DeviceRequests[].Driver` when a case asks for GPUs."""
    stats_interval_s: float = 1.0
    """Seconds between two reads of a running container's stats (memory, CPU, processes)."""
    runner_nats: RunnerNats | None = None
    """Where the runners publish the live view themselves (None: the dispatcher relays the job log)."""


def image_reference(image: str) -> tuple[str, str]:
    """(`fromImage`, `tag`) for a pull: the tag or digest split off, `latest` when none (an empty
    tag would make the engine pull every tag)."""
    if "@" in image:
        repo, digest = image.split("@", 1)
        return repo, digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon + 1 :]
    return image, "latest"


def container_name(run_id: str, attempt: int) -> str:
    """A fresh container name for one execution of an attempt (`[a-zA-Z0-9][a-zA-Z0-9_.-]+`)."""
    return f"evb-{label_value(run_id)}-a{attempt}-{token.token_hex(3)}"


def resolve_secrets(job: CaseRequested, store: SecretStore) -> dict[str, str]:
    """The harness's secret variables with their values; `BackendError` (config) for one the store lacks."""
    values: dict[str, str] = {}
    for var, name in job.harness.secret_env.items():
        secret = store.get(name)
        if secret is None:
            raise BackendError(
                f"secret {name!r} (for {var}) is not in the dispatcher's secret store",
                code="missing_secret",
                failure_class="config",
                retryable=False,
            )
        values[var] = secret.reveal()
    return values


def container_body(
    job: CaseRequested, run_id: str, template: DockerTemplate, secret_env: Mapping[str, str],
    live: RunnerLive | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The `POST /containers/create` body (`ContainerCreateRequest`) for one execution of a case attempt
    (`secret_env`: the harness's secrets, by variable). It holds the secret values: it is sent,
    never logged."""
    compute = job.harness.resources()
    spec = runner_job(job, run_id, live=live)
    labels = {MANAGED_LABEL: "evalbus", RUN_LABEL: run_id, "dev.evalbus.attempt": str(job.attempt)}
    if job.batch_id is not None:
        labels["dev.evalbus.batch"] = job.batch_id
    host: dict[str, Any] = {
        "NanoCpus": max(1, int(compute.cpu * 1e9)),
        "Memory": compute.memory_mb * _MIB,
        "MemorySwap": compute.memory_mb * _MIB,
        "NetworkMode": "none" if compute.network == "none" else template.network,
        "RestartPolicy": {"Name": "no"},
        "AutoRemove": False,
        "Init": True,
    }
    if compute.gpus:
        host["DeviceRequests"] = [{"Driver": template.gpu_driver, "Count": compute.gpus, "Capabilities": [["gpu"]]}]
    env = [f"{JOB_ENV}={msgspec.json.encode(spec).decode('utf-8')}"]
    env += [f"{var}={value}" for var, value in secret_env.items()]
    return {
        "Image": compute.image or template.image,
        "Cmd": [*template.runner_command, "--workdir", "work"],
        "WorkingDir": WORKING_DIR,
        "Env": env,
        "Labels": labels,
        "Tty": False,
        "OpenStdin": False,
        "AttachStdout": False,
        "AttachStderr": False,
        "StopTimeout": 5,
        "HostConfig": host,
    }


# ---------------------------------------------------------------- reading the engine (pure)


def read_event(message: Mapping[str, Any]) -> OrchestratorEvent:
    """An engine event (`EventMessage`) as the feed's entry, at the engine's own time."""
    nanos = message.get("timeNano")
    seconds = message.get("time")
    at = None
    if isinstance(nanos, int) and nanos > 0:
        at = datetime.fromtimestamp(nanos / 1e9, tz=UTC)
    elif isinstance(seconds, int | float) and seconds > 0:
        at = datetime.fromtimestamp(seconds, tz=UTC)
    action = str(message.get("Action") or message.get("status") or "")
    attributes = (message.get("Actor") or {}).get("Attributes") or {}
    details = [f"{key}={attributes[key]}" for key in ("exitCode", "signal") if key in attributes]
    words = f"container {attributes.get('name', '')}".rstrip() + f" {action}"
    return OrchestratorEvent(at=at, kind="Container", reason=action, message=" ".join([words, *details]))


def read_container(inspect: Mapping[str, Any] | None, node: str | None, events: tuple[OrchestratorEvent, ...] = ()
                   ) -> UnitPlacement:  # fmt: skip
    """`GET /containers/{id}/json` (or None: not created, or removed) normalised to a placement."""
    if inspect is None:
        return UnitPlacement(phase="queued", reason="the container is not created", node=node, events=events)
    state = inspect.get("State") or {}
    unit = str(inspect.get("Id") or "")[:12] or None
    restarts = int(inspect.get("RestartCount") or 0)
    status = state.get("Status")
    base = UnitPlacement(phase="starting", unit=unit, node=node, restarts=restarts, events=events)
    if status in ("exited", "dead"):
        oom = bool(state.get("OOMKilled"))
        code = int(state.get("ExitCode") or 0)
        error = state.get("Error") or ""
        reason = ("OOMKilled" if oom else "exited") + f" (exit {code})" + (f": {error}" if error else "")
        return _replace(base, phase="dead", reason=reason, oom=oom, exit_code=code)
    if status in ("running", "paused", "restarting") or state.get("Running"):
        return _replace(base, phase="running")
    if status == "removing":
        return _replace(base, phase="dead", reason="the container is being removed")
    return _replace(base, reason="created, not started")


def _replace(placement: UnitPlacement, **changes: Any) -> UnitPlacement:
    fields = {name: getattr(placement, name) for name in UnitPlacement.__slots__}
    fields.update(changes)
    return UnitPlacement(**fields)


def fit_problem(compute: ComputeSpec, info: Mapping[str, Any]) -> str | None:
    """Why a case can never run on this engine (`/info`: `NCPU`, `MemTotal`, `Labels`); None: it fits."""
    cpus, memory = int(info.get("NCPU") or 0), int(info.get("MemTotal") or 0)
    name = info.get("Name") or "the engine"
    labels = dict(str(item).partition("=")[::2] for item in info.get("Labels") or ())
    missing = {k: v for k, v in compute.node_selector.items() if labels.get(k) != v}
    if missing:
        return f"no engine with labels {missing}: {name} has {sorted(info.get('Labels') or [])}"
    if cpus and compute.cpu > cpus:
        return f"no engine can ever fit cpu={compute.cpu:g}: {name} has {cpus} CPUs"
    if memory and compute.memory_mb * _MIB > memory:
        return f"no engine can ever fit memory={compute.memory_mb}Mi: {name} has {memory // _MIB}Mi"
    return None


def read_stats(stats: Mapping[str, Any], pid: int | None) -> UnitUsage:
    """`GET /containers/{id}/stats` as the unit's usage: memory less the page cache (`inactive_file`,
    as the docker CLI reports it), CPU time, processes."""
    memory = stats.get("memory_stats") or {}
    used = memory.get("usage")
    cache = (memory.get("stats") or {}).get("inactive_file") or 0
    cpu = ((stats.get("cpu_stats") or {}).get("cpu_usage") or {}).get("total_usage")
    pids = (stats.get("pids_stats") or {}).get("current")
    return UnitUsage(
        pid=pid,
        processes=int(pids) if isinstance(pids, int) and pids > 0 else 1,
        rss_bytes=max(0, int(used) - int(cache)) if isinstance(used, int) and used > 0 else None,
        cpu_seconds=cpu / 1e9 if isinstance(cpu, int) and cpu > 0 else None,
    )


def masker(values: list[str]) -> Callable[[str], str]:
    """Replaces every secret value in a text (longest first)."""
    secrets = sorted({v for v in values if v}, key=len, reverse=True)

    def mask(text: str) -> str:
        for value in secrets:
            text = text.replace(value, REDACTED)
        return text

    return mask


class StreamMask:
    """Secret values masked in a byte stream read in chunks (a terminal's output): the end of a chunk
    that could begin a value is held back until the next chunk shows whether it does, or `flush`."""

    def __init__(self, values: list[str]) -> None:
        self._values = sorted({v.encode("utf-8") for v in values if v}, key=len, reverse=True)
        self._held = b""

    @property
    def holding(self) -> bool:
        """Bytes are held back (the caller flushes them when no more output comes)."""
        return bool(self._held)

    def push(self, chunk: bytes) -> bytes:
        """What can be shown of `chunk` now, masked."""
        data = self._held + chunk
        for value in self._values:
            data = data.replace(value, REDACTED.encode("utf-8"))
        keep = self._partial(data)
        self._held = data[len(data) - keep :]
        return data[: len(data) - keep]

    def flush(self) -> bytes:
        """The bytes held back (no value followed them)."""
        held, self._held = self._held, b""
        return held

    def _partial(self, data: bytes) -> int:
        """Length of the longest end of `data` that begins a value."""
        best = 0
        for value in self._values:
            for n in range(min(len(value) - 1, len(data)), best, -1):
                if data.endswith(value[:n]):
                    best = n
                    break
        return best
