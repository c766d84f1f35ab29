"""Lanes, the pure parts: the lane name rule and where a bad one is reported (harness, inline
case, uploaded dataset), the subjects and consumers of each lane (a request written before lanes
existed is in the default lane), the dispatcher's `DISPATCHER_LANES`, the placement reason of a run
whose lane no dispatcher serves, and the lane user's grants in the NATS account table."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import pytest

from evalbus.infra import nats_accounts
from evalbus.infra.nats import nats_server_binary
from evalbus_api.live import Asked
from evalbus_api.validation import batch_spec_problems
from evalbus_contracts import (
    BatchSpec,
    CasePlan,
    CaseRequested,
    CaseSpec,
    CommandHarness,
    DispatcherStatus,
    SuiteSpec,
    decode,
    decode_event,
    encode,
    lane_consumer,
    lane_problem,
    subjects,
)
from evalbus_contracts.streams import CONSUMERS, DISPATCHER_CASES
from evalbus_contracts.subjects import subject_matches
from evalbus_dispatcher.service import DispatcherSettings
from evalbus_gateway.api.errors import ApiError
from evalbus_gateway.api.validation import DatasetChecker
from evalbus_gateway.live.placement import Requested, lanes_waiting, project
from evalbus_runtime import SettingsError, load_settings
from evalbus_runtime.nkeys import AccountKey

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parent / "fixtures" / "events" / "case.requested.v1.json"
DEPLOY_NATS = Path(__file__).resolve().parents[1] / "deploy" / "nats"
NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


# ---------------------------------------------------------------- the name rule


@pytest.mark.parametrize("lane", ["default", "gpu", "nomad-eu", "a", "0", "laptop_ana", "x" * 32])
def test_lane_names(lane: str) -> None:
    assert lane_problem(lane) is None


@pytest.mark.parametrize("lane", ["", "GPU", "gpu.eu", "gpu eu", "-gpu", "_x", "gp*", "a>", "é", "x" * 33])
def test_not_lane_names(lane: str) -> None:
    assert lane_problem(lane) is not None


def spec(harness_lane: str = "default", case_lane: str | None = None) -> BatchSpec:
    return BatchSpec(
        suite=SuiteSpec(id="s", cases=(CaseSpec(id="c1", input="x", lane=case_lane),)),
        harness=CommandHarness(id="h", command=("cat",), lane=harness_lane),
    )


def test_a_bad_lane_is_reported_at_the_harness_or_the_case() -> None:
    assert batch_spec_problems(spec()) == []
    assert batch_spec_problems(spec("gpu", "default")) == []
    assert [p.field for p in batch_spec_problems(spec("GPU"))] == ["$.harness.lane"]
    assert [p.field for p in batch_spec_problems(spec(case_lane="a.b"))] == ["$.suite.cases[0].lane"]


def test_a_bad_lane_in_an_uploaded_dataset_names_its_line() -> None:
    checker = DatasetChecker()
    checker.feed(b'{"id": "c1", "input": "x", "lane": "gpu"}\n{"id": "c2", "input": "y", "lane": "Big Box"}\n')
    with pytest.raises(ApiError) as info:
        checker.finish()
    assert (info.value.status, info.value.field) == (400, "line 2, $.lane")


def test_the_default_lane_is_left_out_of_an_encoded_harness() -> None:
    # an older gateway, which does not know the key, still takes what a newer CLI sends
    assert "lane" not in json.loads(encode(CommandHarness(id="h", command=("cat",))))
    assert json.loads(encode(CommandHarness(id="h", command=("cat",), lane="gpu")))["lane"] == "gpu"


# ---------------------------------------------------------------- subjects and consumers


def request(harness_lane: str = "default", case_lane: str | None = None) -> CaseRequested:
    batch = spec(harness_lane, case_lane)
    return CaseRequested(
        batch_id="b1",
        case_id="c1",
        run_id="evb-b1-c1",
        case=batch.suite.cases[0],
        harness=batch.harness,
        plan=CasePlan(),
    )


def takers(subject: str) -> set[str]:
    consumers = (*CONSUMERS, lane_consumer("gpu"), lane_consumer("nomad-eu"))
    return {c.durable for c in consumers if any(subject_matches(f, subject) for f in c.filter_subjects)}


def test_each_lane_has_its_subject_and_only_its_consumer_takes_it() -> None:
    default, gpu, by_case = request(), request("gpu"), request("default", "nomad-eu")
    assert (default.lane, gpu.lane, by_case.lane) == ("default", "gpu", "nomad-eu")
    assert default.subject() == "case.requested.b1.c1"
    assert gpu.subject() == "case.requested.b1.c1.gpu"
    assert by_case.subject() == "case.requested.b1.c1.nomad-eu"
    assert request("gpu", "default").subject() == "case.requested.b1.c1"  # the case's own lane wins
    assert takers(default.subject()) == {"dispatcher-cases", "gateway-recorder"}
    assert takers(gpu.subject()) == {"dispatcher-cases-gpu", "gateway-recorder"}
    assert takers(by_case.subject()) == {"dispatcher-cases-nomad-eu", "gateway-recorder"}
    for event in (default, gpu, by_case):
        assert any(subject_matches(f, event.subject()) for f in subjects.batch_filter("b1"))
        assert not any(subject_matches(f, event.subject()) for f in subjects.batch_filter("b2"))
    assert lane_consumer("default") is DISPATCHER_CASES
    assert lane_consumer("gpu").durable == "dispatcher-cases-gpu"
    assert lane_consumer("gpu").max_ack_pending == DISPATCHER_CASES.max_ack_pending


def test_a_request_written_before_lanes_existed_is_in_the_default_lane() -> None:
    old = decode_event(FIXTURE.read_bytes())
    assert isinstance(old, CaseRequested)
    assert "lane" not in json.loads(FIXTURE.read_bytes())["harness"]
    assert old.lane == "default"
    assert old.subject() == subjects.case_subject(subjects.CASE_REQUESTED, old.batch_id or "", old.case_id or "")
    assert takers(old.subject()) == {"dispatcher-cases", "gateway-recorder"}


# ---------------------------------------------------------------- the dispatcher's setting


def test_dispatcher_lanes_from_the_environment() -> None:
    plain = load_settings(DispatcherSettings, "dispatcher", {})
    assert (plain.served_lanes(), plain.fans_out()) == (("default",), True)
    gpu = load_settings(DispatcherSettings, "dispatcher", {"DISPATCHER_LANES": " gpu, nomad-eu,gpu "})
    assert (gpu.served_lanes(), gpu.fans_out()) == (("gpu", "nomad-eu"), False)
    both = load_settings(DispatcherSettings, "dispatcher", {"DISPATCHER_LANES": "gpu,default"})
    assert both.fans_out()
    forced = load_settings(DispatcherSettings, "dispatcher", {"DISPATCHER_LANES": "gpu", "DISPATCHER_FANOUT": "true"})
    assert forced.fans_out()


def test_a_lane_setting_that_is_no_lane_name_stops_the_dispatcher_naming_it() -> None:
    with pytest.raises(SettingsError, match=r"DISPATCHER_LANES: 'GPU box'"):
        load_settings(DispatcherSettings, "dispatcher", {"DISPATCHER_LANES": "default,GPU box"})


# ---------------------------------------------------------------- visible waiting


def status(name: str, lanes: tuple[str, ...], *, age_s: float = 0.5) -> DispatcherStatus:
    at = NOW - timedelta(seconds=age_s)
    return DispatcherStatus(dispatcher=name, slots=2, started_at=at, updated_at=at, interval_s=2.0, lanes=lanes)


def waiting(lane: str, statuses: list[DispatcherStatus]) -> tuple[str, str | None, int]:
    view = project(
        run_id="evb-b1-c1",
        status="queued",
        marks=[],
        sample=None,
        requested=Requested(attempt=1, asked=Asked(), ahead=2, lane=lane),
        statuses=statuses,
        now=NOW,
    )
    assert view.queue is not None
    assert view.queue.lane == lane
    return view.phase, view.reason, view.queue.dispatchers


def test_a_run_whose_lane_no_dispatcher_serves_is_blocked_saying_so() -> None:
    phase, reason, serving = waiting("gpu", [status("d-1", ("default",)), status("d-2", ("default", "nomad-eu"))])
    assert (phase, serving) == ("blocked", 0)
    assert reason == (
        "no dispatcher serves lane gpu: the run waits for one started with DISPATCHER_LANES=gpu; "
        "the 2 running serve default, nomad-eu"
    )
    phase, reason, _ = waiting("gpu", [])
    assert reason == "no dispatcher serves lane gpu: the run waits for one started with DISPATCHER_LANES=gpu"
    phase, reason, _ = waiting("gpu", [status("d-gone", ("gpu",), age_s=60.0)])
    assert phase == "blocked"
    assert reason is not None
    assert "(the last one, d-gone, was last seen at" in reason


def test_a_run_in_a_served_lane_is_queued_counting_only_that_lanes_dispatchers() -> None:
    phase, reason, serving = waiting("gpu", [status("d-1", ("default",)), status("d-gpu", ("gpu",))])
    assert (phase, serving) == ("queued", 1)
    assert reason == "waiting to be taken by a dispatcher: 2 ahead of it; 2 of 2 slot(s) free (d-gpu: 0/2)"
    phase, reason, _ = waiting("default", [status("d-gpu", ("gpu",))])
    assert (phase, reason) == (
        "blocked",
        "no dispatcher serves lane default: the run waits for one started with DISPATCHER_LANES=default; "
        "the 1 running serve gpu",
    )
    assert waiting("default", [])[1] == "no dispatcher is running: the run waits for one to start"


def test_a_batchs_lanes_that_no_dispatcher_serves() -> None:
    alive = [status("d-1", ("default",)), status("d-old", ("gpu",), age_s=60.0)]
    waits = lanes_waiting(["default", "gpu", "gpu", "nomad-eu"], alive, NOW)
    assert [w.lane for w in waits] == ["gpu", "nomad-eu"]
    assert waits[0].reason.startswith("no dispatcher serves lane gpu: ")
    assert "(the last one, d-old, was last seen at" in waits[0].reason
    assert lanes_waiting(["default"], alive, NOW) == ()


def test_a_status_written_before_lanes_existed_serves_the_default_lane() -> None:
    old = {"dispatcher": "d-old", "slots": 2, "started_at": NOW.isoformat(), "updated_at": NOW.isoformat()}
    assert decode(msgspec.json.encode(old), DispatcherStatus).lanes == ("default",)


# ---------------------------------------------------------------- the lane user's grants


def allowed(grants: list[nats_accounts.Grant], subject: str) -> bool:
    return any(subject_matches(g.subject, subject) for g in grants)


def test_a_lane_user_may_use_its_lanes_consumer_only() -> None:
    pub = nats_accounts.lane_publish_grants("gpu")
    sub = nats_accounts.lane_subscribe_grants("gpu")
    mine = lane_consumer("gpu")
    assert (nats_accounts.lane_durable("gpu"), nats_accounts.lane_filter("gpu")) == (
        mine.durable,
        mine.filter_subjects[0],
    )
    assert allowed(pub, f"$JS.API.CONSUMER.CREATE.CASES.{mine.durable}.{mine.filter_subjects[0]}")
    assert allowed(pub, f"$JS.API.CONSUMER.MSG.NEXT.CASES.{mine.durable}")
    assert allowed(pub, f"$JS.ACK.CASES.{mine.durable}.1.2.3.4.5")
    assert not allowed(pub, f"$JS.API.CONSUMER.CREATE.CASES.{mine.durable}.case.requested.>")
    assert not allowed(pub, "$JS.API.CONSUMER.CREATE.CASES")  # it would update any durable by name
    for other in (*CONSUMERS, lane_consumer("nomad-eu")):
        assert not allowed(pub, f"$JS.API.CONSUMER.MSG.NEXT.{other.stream}.{other.durable}"), other.durable
        assert not allowed(pub, f"$JS.API.CONSUMER.DURABLE.CREATE.{other.stream}.{other.durable}"), other.durable
        assert not allowed(pub, f"$JS.ACK.{other.stream}.{other.durable}.1.2.3.4.5"), other.durable
    assert allowed(pub, "case.requested.b1.c1.gpu")  # a retry of its own lane's case
    assert not allowed(pub, "case.requested.b1.c1")
    assert not allowed(pub, "case.requested.b1.c1.nomad-eu")
    for refused in ("batch.requested.b1", "case.judged.b1.c1", "$JS.API.STREAM.UPDATE.CASES", "$KV.terminal-tickets.x"):
        assert not allowed(pub, refused), refused
    assert allowed(sub, "_INBOX.lane-gpu.abc.1")
    assert not allowed(sub, "_INBOX.abc.1")
    assert not allowed(sub, "case.requested.b1.c1.nomad-eu")


def test_the_account_with_lane_users_renders_them(tmp_path: Path) -> None:
    text = nats_accounts.render({"gpu": None, "nomad-eu": "p0123"})
    assert "LANE_GPU_PERMISSIONS = {" in text
    assert "{user: lane-gpu, password: $NATS_PASSWORD_LANE_GPU, permissions: $LANE_GPU_PERMISSIONS}" in text
    assert '{user: lane-nomad-eu, password: "p0123", permissions: $LANE_NOMAD_EU_PERMISSIONS}' in text
    assert nats_accounts.render() == nats_accounts.render({})


def test_the_conf_printed_for_a_deployment_parses_with_the_lane_users_password(tmp_path: Path) -> None:
    """What `evalbus lane credential gpu --conf` prints, put into the deployment's accounts.conf,
    is accepted by `nats-server -t` (and the lane's password comes from the environment)."""
    conf = nats_accounts.render({"gpu": None})
    (tmp_path / "accounts.conf").write_text(conf, encoding="utf-8")
    (tmp_path / "jetstream.conf").write_text((DEPLOY_NATS / "jetstream.conf").read_text(), encoding="utf-8")
    (tmp_path / "nats.conf").write_text("include ./jetstream.conf\ninclude ./accounts.conf\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env |= {"SERVER_NAME": "lanes", "NATS_STORE_DIR": str(tmp_path / "js"), "NATS_MAX_FILE_STORE": "1G"}
    env["NATS_PID_FILE"] = str(tmp_path / "nats.pid")
    users = [*nats_accounts.users(), nats_accounts.lane_user("gpu")]
    env |= {nats_accounts.password_variable(u): "p" + os.urandom(8).hex() for u in users}
    env[nats_accounts.ISSUER_VARIABLE] = AccountKey.generate().public

    def check(environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
        argv = [nats_server_binary(), "-t", "-c", str(tmp_path / "nats.conf")]
        return subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=30, check=False)

    assert check(env).returncode == 0, check(env).stderr
    del env["NATS_PASSWORD_LANE_GPU"]
    missing = check(env)
    assert missing.returncode != 0
    assert "NATS_PASSWORD_LANE_GPU" in missing.stderr
