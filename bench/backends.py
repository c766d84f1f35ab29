"""Backend overhead: dispatch → running → released per case, on every backend.

Each backend runs the same case through `execute_case` (what the dispatcher runs): a Python harness
sleeping `--harness-s` seconds, one compute grader, a secret. `local` runs it for real; `kubernetes`,
`nomad` and `docker` run it against the protocol-level fakes (`evalbus.testing.fake_kubernetes`,
`fake_nomad`, `fake_docker`), whose kubelet / client / engine run the real in-job runner as a local
process — so the figures are evalbus's own cost (the Job, job or container built and submitted, the
polls or the followed log and events, the log decoded, the release), not a cluster's or an engine's.

Per case: **submit → running** (provision until the harness's `placed` mark), **running → exited**,
**exited → released**, and the **hold** (provision → release) beside the harness's own time. The
baseline measured in the same run is the **bare runner**: `python -m evalbus.runner` with the same
job spec as a plain subprocess (what any cluster pays to start the runner and the harness).

Goals: on each cluster backend the median hold ≤ `--cluster-goal` (1.5) × (bare runner + 3 polls):
the runner's own wall time plus one poll to see the pod running, one to see it end, one for the
final read (the Docker backend does not poll — it follows the log and waits — so the same bound
leaves it the most room). Every case must succeed, with its grader passed. The local backend's row is printed as
the reference a cluster's overhead sits beside (its sandbox hold is judged by `overlap.py`).

    uv run python bench/backends.py [--cases 6] [--harness-s 0.5] [--poll-s 0.05] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/backends.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec
from bench._goals import add_check_flag, goal, goal_notes, verdict
from bench._infra import quiet_logs
from bench._report import fmt, report
from kubernetes import client as k8s

from evalbus.testing.fake_docker import FakeDocker
from evalbus.testing.fake_kubernetes import DEFAULT_IMAGE, FakeKubernetes
from evalbus.testing.fake_nomad import FakeNomad
from evalbus_contracts import (
    CasePlan,
    CaseRequested,
    CaseSpec,
    CommandHarness,
    ComputeSpec,
    Infra,
    Measured,
    PlacementSample,
    TestsPassGrader,
)
from evalbus_contracts.runner import JOB_ENV
from evalbus_dispatcher import LocalBackend, execute_case
from evalbus_dispatcher.backends.base import Backend, Observed, SandboxHandle
from evalbus_dispatcher.backends.docker import DockerTemplate, connect_docker
from evalbus_dispatcher.backends.job_spec import runner_job
from evalbus_dispatcher.backends.kubernetes import JobTemplate, KubernetesBackend
from evalbus_dispatcher.backends.nomad import NomadTemplate, connect_nomad
from evalbus_dispatcher.execute import MarkFn
from evalbus_dispatcher.screen import Declared
from evalbus_runtime.secrets import SecretStore

SECRET = "bench-secret-5d1c"
AGENT = """\
import os, sys, time
sys.stdin.read()
time.sleep(float(os.environ["BENCH_HARNESS_S"]))
open("answer.txt", "w").write("42")
print('EVALBUS_RESULT {"answer": "42"}')
"""
RUNNER = (sys.executable, "-m", "evalbus.runner")
CLUSTERS = ("kubernetes", "nomad", "docker")
"""Backends that run the in-job runner (their hold is judged against the bare runner)."""
BACKENDS = ("local", *CLUSTERS)


class _Quiet:
    """A live sink dropping everything (the phases are read off the sealed marks' own times)."""

    async def log(self, stream: Any, text: str) -> None:
        return None

    async def trace(self, events: Any) -> None:
        return None

    async def infra(self, marks: Sequence[Infra]) -> None:
        return None

    async def placement(self, sample: PlacementSample) -> None:
        return None


def request(i: int, harness_s: float) -> CaseRequested:
    """Case `i` of the run."""
    return CaseRequested(
        batch_id="bench-backends",
        case_id=f"c{i}",
        run_id=f"evb-bench-backends-c{i}-{os.getpid()}",
        case=CaseSpec(id=f"c{i}", input="6 x 7?", graders=(TestsPassGrader(id="t", command="grep -q 42 answer.txt"),)),
        harness=CommandHarness(
            id="agent",
            command=(sys.executable, "agent.py"),
            files={"agent.py": AGENT},
            env={"BENCH_HARNESS_S": str(harness_s)},
            secret_env={"API_KEY": "api-key"},
            compute=ComputeSpec(cpu=0.25, memory_mb=256),
        ),
        plan=CasePlan(suite_id="bench", submitted_by="bench"),
    )


@asynccontextmanager
async def backend_named(name: str, poll_s: float, root: Path) -> AsyncIterator[Backend]:
    """The backend under test (the fakes started and stopped around it)."""
    if name == "local":
        environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "EVALBUS_SECRET_API_KEY": SECRET}
        yield LocalBackend(slots=8, root=root, secrets=SecretStore(environ), environ=environ)
    elif name == "kubernetes":
        async with FakeKubernetes() as fake:
            fake.add_node("node-a", cpu=8, memory="8Gi")
            fake.add_secret("api-key", {"value": SECRET})
            config = k8s.Configuration()
            config.host = fake.url
            template = JobTemplate(namespace="evalbus", image=DEFAULT_IMAGE, runner_command=RUNNER)
            kube = KubernetesBackend(k8s.ApiClient(config), template, slots=8, poll_s=poll_s)
            try:
                yield kube
            finally:
                await kube.close()
            if fake.violations:
                raise RuntimeError(f"the Kubernetes fake saw requests off the API: {fake.violations}")
    elif name == "docker":
        async with FakeDocker(ncpu=8, mem_total=8 * 1024**3) as engine:
            docker_template = DockerTemplate(image=DEFAULT_IMAGE, runner_command=RUNNER)
            docker = connect_docker(
                docker_template, SecretStore({"EVALBUS_SECRET_API_KEY": SECRET}), host=engine.host, slots=8
            )
            try:
                yield docker
            finally:
                await docker.close()
            if engine.violations:
                raise RuntimeError(f"the Docker fake saw requests off the Engine API: {engine.violations}")
    else:
        async with FakeNomad() as agent:
            agent.add_node("node-a", cpu_mhz=8000, memory_mb=8192)
            agent.set_variable("evalbus/secrets/api-key", value=SECRET)
            nomad = connect_nomad(
                NomadTemplate(image="evalbus/case:test", runner_command=RUNNER), address=agent.url, poll_s=poll_s
            )
            try:
                yield nomad
            finally:
                await nomad.close()
            if agent.violations:
                raise RuntimeError(f"the Nomad fake saw requests off the API: {agent.violations}")


async def one_case(backend: Backend, req: CaseRequested) -> dict[str, Any]:
    """Run one case; its phases in seconds."""
    sink = _Quiet()

    async def on_sandbox(handle: SandboxHandle, mark: MarkFn, _declared: Declared) -> Any:
        if isinstance(handle, Observed):
            handle.observe(mark)

        async def detach() -> None:
            return None

        return detach

    done = await execute_case(req, backend, live=sink, on_release=lambda: None, on_sandbox=on_sandbox)
    scores = done.result.scores
    ok = done.status == "succeeded" and bool(scores) and isinstance(scores[0], Measured) and scores[0].passed
    at: dict[str, float] = {}  # each mark's first time on the run's clock, as sealed
    for event in done.result.trace:
        if isinstance(event, Infra) and event.event is not None:
            at.setdefault(event.event, event.t)
    timings = done.result.timings
    return {
        "ok": ok,
        "failure": None if done.result.failure is None else done.result.failure.message,
        "submit_to_running_s": at.get("placed", float("nan")) - at.get("started", 0.0),
        "running_to_exited_s": at.get("exited", float("nan")) - at.get("placed", float("nan")),
        "exited_to_released_s": at.get("released", float("nan")) - at.get("exited", float("nan")),
        "hold_s": timings.sandbox_seconds if timings is not None else float("nan"),
        "harness_s": timings.harness_seconds if timings is not None else float("nan"),
    }


async def bare_runner(req: CaseRequested, root: Path) -> float:
    """Wall seconds of `python -m evalbus.runner` running the same job as a plain subprocess."""
    spec = runner_job(req, req.run_id or "bare")
    work = Path(tempfile.mkdtemp(dir=root))
    env = {"PATH": os.environ.get("PATH", ""), JOB_ENV: msgspec.json.encode(spec).decode(), "API_KEY": SECRET}
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *RUNNER, "--workdir", str(work / "work"), env=env, stdout=asyncio.subprocess.PIPE, cwd=work
    )
    await proc.communicate()
    return time.monotonic() - started


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(float(r[key]) for r in rows))


async def main(args: argparse.Namespace) -> dict[str, Any]:
    quiet_logs()
    out: dict[str, Any] = {"benchmark": "backends", "load_average": os.getloadavg()[0]}
    per: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="evalbus-bench-backends-") as tmp:
        root = Path(tmp)
        bare = [await bare_runner(request(i, args.harness_s), root) for i in range(args.cases)]
        for name in BACKENDS:
            async with backend_named(name, args.poll_s, root) as backend:
                await one_case(backend, request(-1, args.harness_s))  # warm: imports, connections
                per[name] = [await one_case(backend, request(i, args.harness_s)) for i in range(args.cases)]
    bare_s = statistics.median(bare)
    bound = bare_s + 3 * args.poll_s
    summary = {
        name: {
            key: _median(rows, key)
            for key in ("submit_to_running_s", "running_to_exited_s", "exited_to_released_s", "hold_s", "harness_s")
        }
        for name, rows in per.items()
    }
    goals = [
        goal(
            f"{name} hold / (bare runner + 3 polls)",
            summary[name]["hold_s"] / bound,
            "<=",
            args.cluster_goal,
            f"bare runner {bare_s:.3f}s + 3 x {args.poll_s:g}s poll, same run (medians)",
        )
        for name in CLUSTERS
    ]
    goals.append(
        goal(
            "cases succeeded with their grader passed",
            float(sum(r["ok"] for rows in per.values() for r in rows)),
            "==",
            float(len(BACKENDS) * args.cases),
            "exact",
        )
    )
    out.update(
        params={"cases": args.cases, "harness_s": args.harness_s, "poll_s": args.poll_s},
        bare_runner_s=bare_s,
        bound_s=bound,
        backends=summary,
        failures=[r["failure"] for rows in per.values() for r in rows if not r["ok"]],
        goals=goals,
        ok=all(g.passed for g in goals),
    )
    return out


def cli() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cases", type=int, default=6)
    parser.add_argument("--harness-s", type=float, default=0.5)
    parser.add_argument("--poll-s", type=float, default=0.05, help="the cluster backends' poll interval")
    parser.add_argument("--cluster-goal", type=float, default=1.5)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    out = asyncio.run(main(args))
    table = [("backend", "submit→running s", "running→exited s", "exited→released s", "hold s", "harness s")]
    for name, s in out["backends"].items():
        table.append(
            (
                name,
                fmt(s["submit_to_running_s"], digits=3),
                fmt(s["running_to_exited_s"], digits=3),
                fmt(s["exited_to_released_s"], digits=3),
                fmt(s["hold_s"], digits=3),
                fmt(s["harness_s"], digits=3),
            )
        )
    table.append(("bare runner", "", "", "", fmt(out["bare_runner_s"], digits=3), ""))
    notes = [*goal_notes(out["goals"]), f"load average {out['load_average']:.2f}"]
    if out["failures"]:
        notes.append(f"failures: {out['failures']}")
    report(out, table, notes, args.json)
    sys.exit(verdict("backends", out["goals"], check=args.check))


if __name__ == "__main__":
    cli()
