"""`network: none` on Kubernetes beyond the behaviour suite's scenario: the deny-all NetworkPolicy
when the namespace already has it, and when the dispatcher may not create it. Against the
**protocol-level** fake API server (`evalbus.testing.fake_kubernetes`), not a real cluster: it
validates and stores NetworkPolicies but enforces none."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import pytest
from kubernetes import client as k8s

from evalbus.testing.fake_kubernetes import DEFAULT_IMAGE, FakeKubernetes
from evalbus_contracts import CasePlan, CaseRequested, CaseSpec, CommandHarness, ComputeSpec
from evalbus_dispatcher.backends.kubernetes import (
    NETWORK_NONE_POLICY,
    JobTemplate,
    KubernetesBackend,
    network_none_policy,
)
from evalbus_dispatcher.errors import BackendError

pytestmark = pytest.mark.integration

NAMESPACE = "evalbus"
POLICY_PATH = f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies"


def offline_case(case_id: str) -> CaseRequested:
    return CaseRequested(
        batch_id="b-net",
        case_id=case_id,
        run_id=f"evb-b-net-{case_id}",
        case=CaseSpec(id=case_id, input="hi"),
        harness=CommandHarness(
            id="agent",
            command=(sys.executable, "-c", "print(1)"),
            compute=ComputeSpec(cpu=0.5, memory_mb=256, network="none"),
        ),
        plan=CasePlan(suite_id="s", submitted_by="alice"),
    )


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[FakeKubernetes, KubernetesBackend]]:
    async with FakeKubernetes(namespace=NAMESPACE) as fake:
        fake.add_node("node-a", cpu=2, memory="2Gi")
        config = k8s.Configuration()
        config.host = fake.url
        template = JobTemplate(
            namespace=NAMESPACE, image=DEFAULT_IMAGE, runner_command=(sys.executable, "-m", "evalbus.runner")
        )
        backend = KubernetesBackend(k8s.ApiClient(config), template, slots=2, poll_s=0.05)
        try:
            yield fake, backend
        finally:
            await backend.close()
        assert fake.violations == [], fake.violations


async def test_a_policy_the_namespace_already_has_is_used_as_it_is(
    cluster: tuple[FakeKubernetes, KubernetesBackend],
) -> None:
    fake, backend = cluster
    theirs = {**network_none_policy(NAMESPACE), "metadata": {"name": NETWORK_NONE_POLICY, "labels": {"by": "ops"}}}
    fake.network_policies[(NAMESPACE, NETWORK_NONE_POLICY)] = theirs
    sandbox = await backend.provision(offline_case("c1"))
    await sandbox.release()
    assert fake.network_policies[(NAMESPACE, NETWORK_NONE_POLICY)] is theirs  # a 409, not replaced
    assert [r for r in fake.requests if r[1] == POLICY_PATH] == [("POST", POLICY_PATH)]
    assert len(fake.created_jobs) == 1


async def test_a_policy_the_dispatcher_may_not_create_fails_the_case_before_its_job(
    cluster: tuple[FakeKubernetes, KubernetesBackend],
) -> None:
    fake, backend = cluster
    fake.forbid_network_policies = True
    with pytest.raises(BackendError) as caught:
        await backend.provision(offline_case("c1"))
    assert (caught.value.code, caught.value.failure_class, caught.value.retryable) == (
        "orchestrator_refused",
        "config",
        False,
    )
    assert NETWORK_NONE_POLICY in caught.value.message
    assert "forbidden" in caught.value.message
    assert fake.created_jobs == []  # never run with the network
    fake.forbid_network_policies = False  # the Role fixed: the next case creates it
    sandbox = await backend.provision(offline_case("c2"))
    await sandbox.release()
    assert list(fake.network_policies) == [(NAMESPACE, NETWORK_NONE_POLICY)]
    assert [r for r in fake.requests if r[1] == POLICY_PATH] == [("POST", POLICY_PATH)] * 2
