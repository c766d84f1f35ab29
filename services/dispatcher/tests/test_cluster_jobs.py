"""The cluster backends' pure parts: the Job / job they submit, names and labels, secret references,
reading a blocked evaluation; and what the fake Nomad agent takes: the network block, the
allocation filesystem's requests."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import aiohttp
import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from evalbus.testing.fake_nomad import FakeNomad
from evalbus.testing.pipeline import eventually
from evalbus_contracts import CasePlan, CaseRequested, CaseSpec, CommandHarness, ComputeSpec, TestsPassGrader
from evalbus_dispatcher.backends.job_spec import label_value
from evalbus_dispatcher.backends.kubernetes import (
    NETWORK_LABEL,
    JobTemplate,
    job_manifest,
    job_name,
    network_none_policy,
    secret_ref,
)
from evalbus_dispatcher.backends.nomad import NomadTemplate, blocked_reason, nomad_job
from evalbus_dispatcher.errors import BackendError

pytestmark = pytest.mark.unit


def request(**compute: object) -> CaseRequested:
    return CaseRequested(
        batch_id="b1",
        case_id="c1",
        run_id="evb-b1-c1",
        case=CaseSpec(id="c1", input="hi", graders=(TestsPassGrader(id="t", command="true", timeout_s=30),)),
        harness=CommandHarness(
            id="agent",
            command=("python", "agent.py"),
            env={"MODE": "fast"},
            secret_env={"API_KEY": "openai", "DB": "db-creds/password"},
            compute=ComputeSpec(**compute),  # type: ignore[arg-type]
        ),
        plan=CasePlan(suite_id="s", submitted_by="alice"),
    )


def test_the_job_validates_strictly_and_carries_secrets_by_name_only() -> None:
    req = request(cpu=2, memory_mb=512, gpus=1, node_selector={"pool": "gpu"})
    manifest = job_manifest(req, "evb-b1-c1", "evb-b1-c1-a1-abcdef", JobTemplate(namespace="ns", image="img:1"))
    kubernetes_validate.validate(manifest, "1.33", strict=True)
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"cpu": "2", "memory": "512Mi", "nvidia.com/gpu": "1"}
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert manifest["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu"}
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert refs == {"API_KEY": {"name": "openai", "key": "value"}, "DB": {"name": "db-creds", "key": "password"}}
    job = json.loads(next(e["value"] for e in container["env"] if e["name"] == "EVALBUS_JOB"))
    assert job["secret_vars"] == ["API_KEY", "DB"]
    assert job["checks"] == [{"command": "true", "timeout_s": 30.0}]
    assert manifest["metadata"]["annotations"]["evalbus.dev/run"] == "evb-b1-c1"


@pytest.mark.parametrize("bad", ["Has_Upper", "../escape", "a" * 254, "name/bad key"])
def test_a_name_that_is_no_secret_name_is_a_config_failure(bad: str) -> None:
    with pytest.raises(BackendError) as caught:
        secret_ref(bad, "API_KEY")
    assert (caught.value.failure_class, caught.value.retryable) == ("config", False)
    assert "API_KEY" in caught.value.message


@pytest.mark.parametrize("run_id", ["evb-b1-c1", "evb-" + "x" * 100, "evb-run-ünïcode id*>", "-.weird."])
def test_names_and_labels_are_valid_for_any_run_id(run_id: str) -> None:
    label = label_value(run_id)
    assert len(label) <= 63
    assert re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", label)
    name = job_name(run_id, 2)
    assert len(name) <= 63
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name)
    assert job_name(run_id, 2) != name  # every execution gets its own Job
    assert label_value("evb-" + "x" * 100) != label_value("evb-" + "x" * 101)


def test_the_nomad_job_reads_secrets_from_variables_and_constrains_by_meta() -> None:
    body = nomad_job(request(cpu=1.5, memory_mb=300, gpus=2, node_selector={"zone": "eu"}), "evb-b1-c1", "j1",
                     NomadTemplate(image="img:1"))  # fmt: skip
    job = body["Job"]
    task = job["TaskGroups"][0]["Tasks"][0]
    assert task["Resources"] == {"CPU": 1500, "MemoryMB": 300, "Devices": [{"Name": "nvidia/gpu", "Count": 2}]}
    assert job["Constraints"] == [{"LTarget": "${meta.zone}", "RTarget": "eu", "Operand": "="}]
    templates = [t["EmbeddedTmpl"] for t in task["Templates"]]
    assert templates == [
        '{{ with nomadVar "evalbus/secrets/openai" }}API_KEY={{ .value }}{{ end }}',
        '{{ with nomadVar "evalbus/secrets/db-creds/password" }}DB={{ .value }}{{ end }}',
    ]
    assert job["Meta"]["evalbus_run"] == "evb-b1-c1"
    assert task["Config"]["image"] == "img:1"


def test_network_none_labels_the_pod_for_the_deny_all_policy() -> None:
    template = JobTemplate(namespace="ns", image="img:1")
    cut_off = job_manifest(request(network="none"), "evb-b1-c1", "evb-b1-c1-a1-abcdef", template)
    kubernetes_validate.validate(cut_off, "1.33", strict=True)
    assert cut_off["spec"]["template"]["metadata"]["labels"][NETWORK_LABEL] == "none"
    default = job_manifest(request(), "evb-b1-c1", "evb-b1-c1-a1-abcdef", template)
    assert NETWORK_LABEL not in default["spec"]["template"]["metadata"]["labels"]
    policy = network_none_policy("ns")
    kubernetes_validate.validate(policy, "1.33", strict=True)
    assert policy["metadata"] == {"name": "evalbus-network-none", "namespace": "ns",
                                  "labels": {"app.kubernetes.io/managed-by": "evalbus"}}  # fmt: skip
    # No `ingress`/`egress` rules with both types listed: nothing in, nothing out.
    assert policy["spec"] == {"podSelector": {"matchLabels": {NETWORK_LABEL: "none"}},
                              "policyTypes": ["Ingress", "Egress"]}  # fmt: skip


@pytest.mark.parametrize("driver", ["docker", "raw_exec"])
def test_network_none_gives_the_nomad_group_no_network(driver: str) -> None:
    template = NomadTemplate(image="img:1", driver=driver)
    group = nomad_job(request(network="none"), "evb-b1-c1", "j1", template)["Job"]["TaskGroups"][0]
    assert group["Networks"] == [{"Mode": "none"}]
    config = group["Tasks"][0]["Config"]
    assert config.get("network_mode") == ("none" if driver == "docker" else None)
    default = nomad_job(request(), "evb-b1-c1", "j1", template)["Job"]["TaskGroups"][0]
    assert "Networks" not in default
    assert "network_mode" not in default["Tasks"][0]["Config"]


def test_a_blocked_evaluation_reads_as_its_exhausted_dimensions() -> None:
    evaluations: list[dict[str, Any]] = [
        {"Status": "complete"},
        {
            "Status": "blocked",
            "FailedTGAllocs": {
                "case": {
                    "NodesEvaluated": 3,
                    "DimensionExhausted": {"memory": 1, "cpu": 2},
                    "ConstraintFiltered": {"${meta.zone} = eu": 1},
                }
            },
        },
    ]
    assert blocked_reason(evaluations) == (
        "3 nodes evaluated: cpu exhausted on 2 nodes, memory exhausted on 1 node, "
        "constraint ${meta.zone} = eu filtered 1 node"
    )
    assert blocked_reason([{"Status": "complete"}]) is None


@pytest.mark.integration
async def test_the_fake_nomad_agent_takes_the_documented_network_block_only() -> None:
    """The protocol-level fake checks `TaskGroup.Networks[]` as the job API documents it."""
    template = NomadTemplate(image="evalbus/case:test")
    made: list[str] = []

    def job_with(network: dict[str, Any], driver: str = "docker") -> dict[str, Any]:
        made.append(f"j-{len(made)}")
        body = nomad_job(request(network="none"), "evb-b1-c1", made[-1], replace(template, driver=driver))
        body["Job"]["TaskGroups"][0]["Networks"] = [network]
        return body

    async with FakeNomad() as agent, aiohttp.ClientSession() as session:
        raw_exec = job_with({"Mode": "none"}, driver="raw_exec")
        raw_exec["Job"]["TaskGroups"][0]["Tasks"][0]["Config"]["network_mode"] = "none"  # a docker option
        refused = [job_with({"Mode": "airgap"}), job_with({"Mode": "none", "Isolated": True}), raw_exec]
        for body in refused:
            async with session.post(f"{agent.url}/v1/jobs", json=body) as answer:
                assert answer.status == 400, await answer.text()
        assert len(agent.violations) == 3, agent.violations
        assert "airgap" in agent.violations[0]
        assert "Isolated" in agent.violations[1]
        assert "network_mode" in agent.violations[2]
        assert agent.registered == []
        async with session.post(f"{agent.url}/v1/jobs", json=job_with({"Mode": "none"})) as answer:
            assert answer.status == 200, await answer.text()
        assert agent.registered[-1]["TaskGroups"][0]["Networks"] == [{"Mode": "none"}]


def test_the_job_tells_the_runner_to_hold_for_declared_files_and_its_deadline_counts_it() -> None:
    held = job_manifest(request(), "evb-b1-c1", "evb-b1-c1-a1-abcdef", JobTemplate(namespace="ns", image="img:1"))
    unheld = job_manifest(
        request(), "evb-b1-c1", "evb-b1-c1-a1-abcdef", JobTemplate(namespace="ns", image="img:1", artifact_hold_s=0)
    )

    def spec(manifest: dict[str, Any]) -> dict[str, Any]:
        env = manifest["spec"]["template"]["spec"]["containers"][0]["env"]
        return dict(json.loads(next(e["value"] for e in env if e["name"] == "EVALBUS_JOB")))

    assert spec(held)["hold_s"] == 120.0
    assert spec(unheld)["hold_s"] == 0.0
    assert held["spec"]["activeDeadlineSeconds"] == unheld["spec"]["activeDeadlineSeconds"] + 120
    nomad = nomad_job(request(), "evb-b1-c1", "j-1", NomadTemplate(image="img:1"))
    assert json.loads(nomad["Job"]["TaskGroups"][0]["Tasks"][0]["Env"]["EVALBUS_JOB"])["hold_s"] == 0.0  # fs API


async def test_the_fake_nomad_agent_serves_the_allocation_filesystem_as_documented() -> None:
    """`fs/stat` answers `AllocFileInfo`, `fs/cat` and `fs/readat` raw bytes, once the task ended."""
    template = NomadTemplate(image="evalbus/case:test", driver="raw_exec", runner_command=("/bin/sh", "-c"))
    body = nomad_job(request(), "evb-b1-c1", "fs-1", template)
    task = body["Job"]["TaskGroups"][0]["Tasks"][0]
    task["Templates"] = []  # no secrets to wait for
    task["Config"] = {"command": "/bin/sh", "args": ["-c", "mkdir -p ${NOMAD_TASK_DIR}/work && printf 0123456789 > "
                                                     "${NOMAD_TASK_DIR}/work/note.txt"]}  # fmt: skip
    async with FakeNomad() as agent, aiohttp.ClientSession() as session:
        agent.add_node("node-a")
        async with session.post(f"{agent.url}/v1/jobs", json=body) as answer:
            assert answer.status == 200, await answer.text()
        await eventually(lambda: any(a.state == "dead" for a in agent.allocs.values()), timeout_s=30,
                         what="the task to end")  # fmt: skip
        [alloc] = agent.allocs
        fs = f"{agent.url}/v1/client/fs"
        async with session.get(f"{fs}/stat/{alloc}", params={"path": "case/local/work/note.txt"}) as answer:
            info = await answer.json()
        assert {k: info[k] for k in ("Name", "IsDir", "Size")} == {"Name": "note.txt", "IsDir": False, "Size": 10}
        assert re.fullmatch(r"-rw-[-r][-w]-[-r]--", info["FileMode"]), info  # Go's FileMode.String(), umask's bits
        async with session.get(f"{fs}/cat/{alloc}", params={"path": "case/local/work/note.txt"}) as answer:
            assert await answer.read() == b"0123456789"
        params = {"path": "case/local/work/note.txt", "offset": "3", "limit": "4"}
        async with session.get(f"{fs}/readat/{alloc}", params=params) as answer:
            assert await answer.read() == b"3456"
        async with session.get(f"{fs}/ls/{alloc}", params={"path": "case/local/work"}) as answer:
            assert [e["Name"] for e in await answer.json()] == ["note.txt"]
        async with session.get(f"{fs}/stat/{alloc}", params={"path": "case/local/work/none"}) as answer:
            assert answer.status == 500
            assert "no such file or directory" in await answer.text()
        async with session.get(f"{fs}/stat/{alloc}", params={"path": "../../etc/passwd"}) as answer:
            assert (answer.status, await answer.text()) == (500, "Path escapes the alloc directory")
        assert agent.violations == []
        for path, query in (("stat", {}), ("readat", {"path": "case/local/work/note.txt"}), ("cat", {"path": "x",
                            "follow": "true"})):  # fmt: skip
            async with session.get(f"{fs}/{path}/{alloc}", params=query) as answer:
                assert answer.status == 400
        assert len(agent.violations) == 3, agent.violations
