"""Settings, secrets, health/metrics endpoints and traceparent propagation of the chassis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from nats.js.errors import NotFoundError

from evalbus.infra.nats import NatsServer
from evalbus.testing.bus import executed, make_consumer, request
from evalbus.testing.pipeline import eventually
from evalbus_contracts import CaseExecuted, CaseRequested, decode_event, encode_token
from evalbus_contracts.events import EventBase
from evalbus_runtime import (
    Delivery,
    Publisher,
    SecretStore,
    Service,
    ServiceSettings,
    SettingsError,
    Stage,
    connect,
    load_settings,
)
from evalbus_runtime.bus import existing_stream
from evalbus_runtime.secrets import MissingSecretError, env_name


class JudgeLike(ServiceSettings):
    concurrency: int = 4
    model_base_url: str | None = None


@pytest.mark.unit
def test_settings_prefer_the_service_prefix_then_the_shared_key() -> None:
    env = {"NATS_URL": "nats://shared:1", "JUDGE_NATS_URL": "nats://judge:2", "CONCURRENCY": "9", "HTTP_PORT": "81"}
    s = load_settings(JudgeLike, "judge", env)
    assert s.nats_url == "nats://judge:2"
    assert s.concurrency == 9
    assert s.http_port == 81
    other = load_settings(JudgeLike, "exporter", env)
    assert other.nats_url == "nats://shared:1"


@pytest.mark.unit
def test_settings_reject_a_bad_value_naming_it() -> None:
    with pytest.raises(SettingsError, match="concurrency"):
        load_settings(JudgeLike, "judge", {"CONCURRENCY": "many"})


@pytest.mark.unit
def test_secret_settings_are_redacted() -> None:
    s = load_settings(ServiceSettings, "gateway", {"DATABASE_URL": "postgresql://u:hunter2@db/x"})
    assert "hunter2" not in repr(s)
    assert "hunter2" not in str(s.redacted())
    assert s.database_url == "postgresql://u:hunter2@db/x"


@pytest.mark.unit
def test_secret_store_reads_env_then_files_and_never_shows_values(tmp_path: Path) -> None:
    (tmp_path / "file-only").write_text("from-file\n")
    store = SecretStore({env_name("api.key"): "from-env", "EVALBUS_SECRETS_DIR": str(tmp_path)})
    assert env_name("api.key") == "EVALBUS_SECRET_API_KEY"
    value = store.require("api.key")
    assert value.reveal() == "from-env"
    assert "from-env" not in repr(value)
    assert "from-env" not in str(value)
    assert store.require("file-only").reveal() == "from-file"
    assert store.get("../etc/passwd") is None
    with pytest.raises(MissingSecretError, match="nope"):
        store.require("nope")


@pytest.mark.integration
async def test_health_ready_and_metrics_endpoints(fresh_nats: NatsServer) -> None:
    service = Service(ServiceSettings(service="probe", nats_url=fresh_nats.url))
    batch = f"b{uuid.uuid4().hex[:6]}"

    async def handle(event: CaseRequested, _: Delivery) -> Sequence[EventBase]:
        return []

    service.add_stage(Stage(consumer=make_consumer(batch), handler=handle, accepts=(CaseRequested,)))
    await service.start()
    try:
        nc = await connect(fresh_nats.url, "t")
        await Publisher(nc).publish_event(request(batch, "c1"))
        base = f"http://127.0.0.1:{service.http_port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/healthz") as r:
                assert r.status == 200
            async with http.get(f"{base}/readyz") as r:
                assert r.status == 200
                assert (await r.json())["checks"]["nats"] is True
            text = ""

            async def counted() -> bool:
                nonlocal text
                async with http.get(f"{base}/metrics") as r:
                    text = await r.text()
                return 'outcome="ignored"} 1.0' in text

            await eventually(counted, timeout_s=30, what="the ignored message counted", diagnostics=lambda: text)
            assert 'evalbus_messages_total{consumer="' in text
            assert 'outcome="ignored"} 1.0' in text
        await nc.close()
    finally:
        await service.stop()


@pytest.mark.integration
async def test_traceparent_is_carried_from_input_to_outputs(fresh_nats: NatsServer) -> None:
    service = Service(ServiceSettings(service="relay", nats_url=fresh_nats.url))
    batch = f"b{uuid.uuid4().hex[:6]}"

    async def handle(event: CaseRequested, _: Delivery) -> Sequence[EventBase]:
        return [executed(event)]

    service.add_stage(Stage(consumer=make_consumer(batch), handler=handle, accepts=(CaseRequested,)))
    await service.start()
    nc = await connect(fresh_nats.url, "t")
    try:
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        sub = await nc.jetstream().subscribe(f"case.executed.{encode_token(batch)}.*", ordered_consumer=True)
        await Publisher(nc).publish_event(request(batch, "c1"), headers={"traceparent": parent})
        msg = await sub.next_msg(timeout=10)
        assert msg.headers is not None
        assert msg.headers["traceparent"] == parent
        assert msg.headers["Nats-Msg-Id"] == f"case.executed:evb-{batch}-c1"
        assert msg.headers["Evalbus-Type"] == "case.executed"
        assert isinstance(decode_event(msg.data), CaseExecuted)
    finally:
        await nc.close()
        await service.stop()


@pytest.mark.integration
async def test_on_published_runs_once_the_output_is_acknowledged_and_only_then(fresh_nats: NatsServer) -> None:
    """A handler's `delivery.on_published` callback runs after its outputs' PubAcks (the published
    counter already counts them), once per delivery with outputs; not for one without outputs, nor
    for one that fails (the dispatcher purges a run's live output only once its result is stored)."""
    service = Service(ServiceSettings(service="hooked", nats_url=fresh_nats.url))
    batch = f"b{uuid.uuid4().hex[:6]}"
    seen: list[tuple[str, float | None]] = []

    def published_so_far() -> float | None:
        return service.metrics.registry.get_sample_value("evalbus_published_total", {"type": "case.executed"})

    async def handle(event: CaseRequested, delivery: Delivery) -> Sequence[EventBase]:
        delivery.on_published(lambda: seen.append((event.case_id or "", published_so_far())))
        if event.case_id == "quiet":
            return []
        if event.case_id == "broken" and delivery.num_delivered == 1:
            raise RuntimeError("fails once")
        return [executed(event)]

    service.add_stage(Stage(consumer=make_consumer(batch), handler=handle, accepts=(CaseRequested,)))
    await service.start()
    nc = await connect(fresh_nats.url, "t")
    try:
        pub = Publisher(nc)
        for case in ("quiet", "broken", "c1"):
            await pub.publish_event(request(batch, case))

        async def both() -> bool:
            return {case for case, _ in seen} == {"broken", "c1"}

        await eventually(both, timeout_s=20, what="the callbacks of the two cases with an output")
        await service.stop()
        assert sorted(case for case, _ in seen) == ["broken", "c1"]  # once each: not the failed delivery
        assert all(count is not None and count >= 1 for _, count in seen), seen
        assert published_so_far() == 2
    finally:
        await nc.close()
        await service.stop()


class _CountingJetStream:
    """The real JetStream context, telling the test each time `stream_info` answered "not found"."""

    def __init__(self, js: Any) -> None:
        self._js = js
        self.missed = asyncio.Event()

    async def stream_info(self, name: str) -> Any:
        try:
            return await self._js.stream_info(name)
        except NotFoundError:
            self.missed.set()
            raise


async def test_a_stream_reported_missing_for_a_moment_is_asked_for_again(fresh_nats: NatsServer) -> None:
    nc = await connect(fresh_nats.url, "settle-test")
    try:
        js = nc.jetstream()
        name = f"LATE{uuid.uuid4().hex[:8].upper()}"
        counting = _CountingJetStream(js)
        waiting = asyncio.create_task(existing_stream(counting, name, settle_s=30))  # type: ignore[arg-type]
        await counting.missed.wait()  # it asked once and heard "not found"
        await js.add_stream(name=name, subjects=[f"{name.lower()}.>"])
        info = await waiting
        assert info.config.name == name

        with pytest.raises(NotFoundError):  # a stream that never comes: the error stands after settle_s
            await existing_stream(js, f"{name}X", settle_s=0.2)
    finally:
        await nc.close()


async def test_a_failed_start_stops_what_it_started(fresh_nats: NatsServer) -> None:
    """A start hook that raises: `start` raises it, and before that stops what was started — the
    stop hooks run, the HTTP port is closed, the NATS connection is closed. Before, all of it was
    left running (a test that retried a failed start leaked a connection and a port each time)."""
    service = Service(ServiceSettings(service="broken-start", nats_url=fresh_nats.url))
    stopped: list[str] = []

    async def fine(_: Service) -> None:
        return None

    async def boom(_: Service) -> None:
        raise RuntimeError("cannot reach the model provider")

    async def stop(_: Service) -> None:
        stopped.append("stop hook")

    service.on_start(fine)
    service.on_start(boom)
    service.on_stop(stop)
    with pytest.raises(RuntimeError, match="cannot reach the model provider"):
        await service.start()
    assert stopped == ["stop hook"]
    assert service.nc.is_closed
    assert service.http_port is not None
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(f"http://127.0.0.1:{service.http_port}/healthz"):
                pass

    # A start that fails before any hook ran (its consumer's stream does not exist) runs no stop
    # hook: there is nothing of theirs to stop.
    early = Service(ServiceSettings(service="broken-early", nats_url=fresh_nats.url, create_topology=False))

    async def handle(event: CaseRequested, _: Delivery) -> Sequence[EventBase]:
        return []

    consumer = msgspec.structs.replace(make_consumer("b-early"), stream="NO_SUCH_STREAM")
    early.add_stage(Stage(consumer=consumer, handler=handle, accepts=(CaseRequested,)))
    early.on_stop(stop)
    with pytest.raises(NotFoundError):
        await early.start()
    assert stopped == ["stop hook"]
    assert early.nc.is_closed
