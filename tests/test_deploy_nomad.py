"""deploy/nomad, validated offline: every job spec parses as HCL2 (`python-hcl2`; no Nomad agent
runs here, so `nomad job validate` is not run), its environment is made of real settings of its
service with credentials only from Nomad Variables, its grace outlives SHUTDOWN_TIMEOUT_S, its
Nomad Autoscaler checks read the lag of the service's own consumers in `evalbus_contracts.streams`,
and the NATS job assembles a configuration that `nats-server -t` accepts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import hcl2
import pytest
import yaml

from evalbus.infra import nats_accounts
from evalbus.infra.nats import nats_server_binary
from evalbus.infra.stack import new_nats_password
from evalbus_collector.service import CollectorSettings
from evalbus_contracts import streams
from evalbus_dispatcher.service import DispatcherSettings
from evalbus_exporter.service import ExporterSettings
from evalbus_gateway.settings import GatewaySettings
from evalbus_judge.service import JudgeSettings
from evalbus_runtime import ServiceSettings, load_settings
from evalbus_runtime.nkeys import AccountKey

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
NOMAD = REPO / "deploy" / "nomad"
SERVICES: dict[str, type[ServiceSettings]] = {
    "gateway": GatewaySettings,
    "dispatcher": DispatcherSettings,
    "collector": CollectorSettings,
    "judge": JudgeSettings,
    "exporter": ExporterSettings,
}
CREDENTIALS = {"NATS_URL", "DATABASE_URL", "GATEWAY_ADMIN_TOKEN"}

Block = dict[str, Any]


def unquote(value: Any) -> Any:
    """python-hcl2 keeps the quotes of strings and labels."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1].replace('\\"', '"')
    return value


def blocks(parent: Block, kind: str) -> list[Block]:
    """The blocks of `kind` in `parent` (labelled blocks keep their label as `__label__`)."""
    out: list[Block] = []
    for item in parent.get(kind, []):
        keys = [k for k in item if not k.startswith("__")]
        if len(keys) == 1 and isinstance(item[keys[0]], dict) and item[keys[0]].get("__is_block__"):
            out.append({**item[keys[0]], "__label__": unquote(keys[0])})
        else:
            out.append(item)
    return out


def load(name: str) -> Block:
    """The one job of a job file."""
    doc = hcl2.loads((NOMAD / name).read_text(encoding="utf-8"))
    (job,) = blocks(doc, "job")
    return job


def heredoc(value: str) -> str:
    """The text of a `<<-EOT` heredoc attribute, as Nomad would see it (indent stripped)."""
    text = unquote(value)
    match = re.fullmatch(r"<<-?(\w+)\n(.*)\n\s*\1", text, re.S)
    assert match, text[:80]
    lines = match[2].split("\n")
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:] for line in lines)


def test_every_job_file_parses() -> None:
    names = sorted(p.name for p in NOMAD.glob("*.nomad.hcl"))
    assert names == sorted([*(f"evalbus-{s}.nomad.hcl" for s in SERVICES), "nats.nomad.hcl"])
    for name in names:
        job = load(name)
        assert job["__label__"] == name.removesuffix(".nomad.hcl").replace("nats", "evalbus-nats")


def _task(service: str) -> tuple[Block, Block, Block]:
    job = load(f"evalbus-{service}.nomad.hcl")
    (group,) = blocks(job, "group")
    (task,) = blocks(group, "task")
    return job, group, task


def _setting_keys(service: str) -> set[str]:
    fields = set(SERVICES[service].__struct_fields__) - {"service"}
    keys = {f.upper() for f in fields} | {f"{service.upper()}_{f.upper()}" for f in fields}
    return keys | {"EVALBUS_STATE_DIR"}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_env_is_made_of_settings_and_credentials_come_from_variables(service: str) -> None:
    _, _, task = _task(service)
    (env_block,) = task["env"]
    env = {k: unquote(v) for k, v in env_block.items() if not k.startswith("__")}
    assert set(env) - _setting_keys(service) == set()
    assert set(env) & CREDENTIALS == set(), "a credential written in the job file"
    for key, value in env.items():
        load_settings(SERVICES[service], service, {key: value})  # raises when the value does not fit
    templated: set[str] = set()
    for template in task["template"]:
        if unquote(template.get("env")) is True or template.get("env") is True:
            text = heredoc(template["data"])
            assert 'nomadVar "nomad/jobs/evalbus-' + service + '"' in text
            templated |= set(re.findall(r"^([A-Z_]+)=\{\{", text, re.M))
    assert "NATS_URL" in templated
    assert templated - _setting_keys(service) == set()
    if service == "gateway":
        assert {"DATABASE_URL", "GATEWAY_ADMIN_TOKEN"} <= templated


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_grace_probes_and_ports(service: str) -> None:
    _, group, task = _task(service)
    env = {k: unquote(v) for k, v in task["env"][0].items() if not k.startswith("__")}
    shutdown = float(env.get(f"{service.upper()}_SHUTDOWN_TIMEOUT_S", env.get("SHUTDOWN_TIMEOUT_S", 30)))
    kill = unquote(task["kill_timeout"])
    assert kill.endswith("s")
    assert float(kill[:-1]) >= shutdown + 10
    assert unquote(task["kill_signal"]) == "SIGTERM"
    assert unquote(task["driver"]) == "docker"
    (network,) = group["network"]
    ports = {p["__label__"]: p for p in blocks(network, "port")}
    assert ports["http"]["to"] == int(env["HTTP_PORT"])
    assert env["HTTP_HOST"] == "0.0.0.0"
    services = {unquote(s["name"]): s for s in group["service"]}
    main = services[f"evalbus-{service}"]
    paths = {unquote(c["path"]) for c in main["check"]}
    assert paths == {"/readyz", "/healthz"}
    if service == "collector":
        assert ports["otlp"]["to"] == int(env["COLLECTOR_OTLP_PORT"])
        assert env["COLLECTOR_OTLP_HOST"] == "0.0.0.0"
        assert "evalbus-collector-otlp" in services


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_autoscaler_checks_read_the_services_own_consumers(service: str) -> None:
    _, group, _ = _task(service)
    (scaling,) = group["scaling"]
    assert scaling["min"] <= group["count"] <= scaling["max"]
    (policy,) = scaling["policy"]
    checks = blocks(policy, "check")
    assert checks
    durables = {c.durable: c for c in streams.CONSUMERS}
    for check in checks:
        query = unquote(check["query"])
        names = set(re.findall(r'consumer_name="([^"]+)"', query))
        assert names == {check["__label__"]}
        consumer = durables[check["__label__"]]
        assert consumer.durable.split("-", 1)[0] == service
        assert set(re.findall(r'stream_name="([^"]+)"', query)) == {consumer.stream}
        assert unquote(check["source"]) == "prometheus"
        assert [s["__label__"] for s in blocks(check, "strategy")] == ["pass-through"]


def _nats_task() -> tuple[Block, Block]:
    job = load("nats.nomad.hcl")
    (group,) = blocks(job, "group")
    tasks = {t["__label__"]: t for t in blocks(group, "task")}
    return group, tasks["nats"]


def test_the_nats_job_is_a_three_node_cluster_with_volumes() -> None:
    group, task = _nats_task()
    assert group["count"] == 3
    assert any(unquote(c["operator"]) == "distinct_hosts" for c in group["constraint"])
    (volume,) = blocks(group, "volume")
    assert unquote(volume["type"]) == "host"
    assert unquote(task["volume_mount"][0]["destination"]) == "/data"
    env = {k: unquote(v) for k, v in task["env"][0].items() if not k.startswith("__")}
    assert env["NATS_STORE_DIR"] == "/data"  # nats-server keeps its store in <dir>/jetstream
    assert unquote(task["kill_signal"]) == "SIGUSR2"  # lame duck mode
    image = unquote(task["config"][0]["image"])
    kube = yaml.safe_load_all((REPO / "deploy/kubernetes/base/nats.yaml").read_text(encoding="utf-8"))
    statefulset = next(d for d in kube if d["kind"] == "StatefulSet")
    assert image == statefulset["spec"]["template"]["spec"]["containers"][0]["image"], "one NATS version"


def test_the_nats_job_assembles_a_config_nats_server_accepts(tmp_path: Path) -> None:
    _, task = _nats_task()
    local = tmp_path / "local"
    local.mkdir()
    for template in task["template"]:
        destination = unquote(template["destination"])
        data = template["data"]
        if data.startswith("${file("):
            match = re.fullmatch(r'\$\{file\("([^"]+)"\)\}', data)
            assert match, data
            source = REPO / match[1]
            assert source.exists(), source
            shutil.copy(source, local / Path(destination).name)
        elif destination.startswith("local/"):
            text = heredoc(data)
            routes = "\n".join(f"    nats://10.0.0.{i}:6222" for i in range(1, 4))
            text = re.sub(r"\{\{- range nomadService .*?\{\{- end \}\}", routes, text, flags=re.S)
            assert "{{" not in text
            (local / Path(destination).name).write_text(text, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env |= {"SERVER_NAME": "evalbus-nats-0", "NATS_STORE_DIR": str(tmp_path / "js"), "NATS_MAX_FILE_STORE": "1G"}
    env["NATS_PID_FILE"] = str(tmp_path / "nats.pid")
    accounts = (local / "accounts.conf").read_text(encoding="utf-8")
    for variable in set(re.findall(r"\$(NATS_PASSWORD_[A-Z_]+)", accounts)):
        env[variable] = new_nats_password()  # os.urandom(8).hex() was read as a number when it looked like one
    env[nats_accounts.ISSUER_VARIABLE] = AccountKey.generate().public
    result = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(local / "nats.conf")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_nomad_scales_like_kubernetes(service: str) -> None:
    _, group, _ = _task(service)
    (scaling,) = group["scaling"]
    checks = {c["__label__"]: unquote(c["query"]) for c in blocks(scaling["policy"][0], "check")}
    targets = {}
    for label, query in checks.items():
        match = re.search(r"\) / (\d+)\) or vector\(0\)$", query)
        assert match, query
        targets[label] = match[1]
    docs = yaml.safe_load_all((REPO / f"deploy/kubernetes/base/{service}.yaml").read_text(encoding="utf-8"))
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")["spec"]
    assert targets == {t["metadata"]["consumer"]: t["metadata"]["lagThreshold"] for t in scaled["triggers"]}
    assert (scaling["min"], scaling["max"]) == (scaled["minReplicaCount"], scaled["maxReplicaCount"])
