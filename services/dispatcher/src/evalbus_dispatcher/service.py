"""Wiring of the dispatcher: fan-out of `batch.requested` (on a replica serving the default lane,
or `DISPATCHER_FANOUT`), execution of `case.requested` of the lanes it serves (`DISPATCHER_LANES`,
one shared consumer per lane) on the local backend with compute slots (a replica pulls only when a
slot is free, and gives the slot back the moment the sandbox is released), live output and placement
samples to the LIVE stream (a cluster job's runner may publish its live log and trace itself,
`DISPATCHER_RUNNER_NATS_URL`), the replica's presence (slots, the runs holding them, its lanes) in the
`dispatchers` bucket, cancellations honoured, job-mode trace collection through `evalbus_traces`,
retries of retryable infrastructure failures."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal
from urllib.parse import urlsplit

from evalbus_contracts import (
    DEFAULT_LANE,
    BatchRequested,
    CaseRequested,
    Infra,
    lane_consumer,
    lane_problem,
    subjects,
)
from evalbus_contracts.control import TERMINAL_PING_S
from evalbus_contracts.events import EventBase, EventKey, stage_output_key
from evalbus_contracts.streams import DISPATCHER_BATCHES
from evalbus_dispatcher.artifacts import RunObjects
from evalbus_dispatcher.backends.base import Mark, SandboxHandle, is_observed
from evalbus_dispatcher.backends.job_spec import LiveHandoffs, RunnerNats
from evalbus_dispatcher.backends.local import LocalBackend
from evalbus_dispatcher.backends.process_group import sweep_orphans
from evalbus_dispatcher.backends.worker import WORKER_IDLE_S
from evalbus_dispatcher.cancellation import Cancellations, cancelled_execution
from evalbus_dispatcher.capacity import ROOM_INTERVAL_S, ClusterRoom
from evalbus_dispatcher.control import LiveControls
from evalbus_dispatcher.execute import Queued, execute_case, run_id_of
from evalbus_dispatcher.fanout import fan_out_batch
from evalbus_dispatcher.live_bus import LiveBus
from evalbus_dispatcher.live_purge import LivePurger, purge_counter
from evalbus_dispatcher.placement import SAMPLE_INTERVAL_S
from evalbus_dispatcher.presence import STATUS_INTERVAL_S, Presence, default_replica_id
from evalbus_dispatcher.retry import next_attempt, should_retry
from evalbus_dispatcher.runner_auth import RunnerAuth, RunTokens
from evalbus_dispatcher.screen import ScreenSessions, capture
from evalbus_dispatcher.trace_puller import PlatformTracePuller
from evalbus_runtime import (
    Delivery,
    Poison,
    Retry,
    SecretStore,
    Service,
    ServiceSettings,
    SlotPool,
    Stage,
    connect,
)
from evalbus_runtime.nkeys import AccountKey

if TYPE_CHECKING:
    # A cluster backend's module (the Kubernetes client above all: 0.7 s of a start on two cores)
    # is imported only by a dispatcher that uses it.
    from evalbus_dispatcher.backends.docker import DockerBackend
    from evalbus_dispatcher.backends.kubernetes import KubernetesBackend
    from evalbus_dispatcher.backends.nomad import NomadBackend

log = logging.getLogger("evalbus.dispatcher")


CLUSTER_SLOTS = 64
"""The most cases a replica holds on a cluster backend unless `DISPATCHER_SLOTS` says otherwise (its
pool follows the cluster's room below that)."""


class DispatcherSettings(ServiceSettings):
    """Settings of the dispatcher (`DISPATCHER_<KEY>`, then `<KEY>`)."""

    SECRET_FIELDS: ClassVar[frozenset[str]] = ServiceSettings.SECRET_FIELDS | {
        "nomad_token",
        "runner_auth_url",
        "runner_auth_seed",
    }

    slots: int | None = None
    """Compute slots: sandboxes at once on this replica, whichever lanes they come from (unset: the
    CPU count on the local backend, `CLUSTER_SLOTS` on a cluster one); on a cluster backend the most
    it holds, the pool following the cluster's room (`capacity.py`)."""
    slots_from_room: bool = True
    """On a cluster backend, size the slots from the cluster's room (False: always `slots`)."""
    room_interval_s: float = ROOM_INTERVAL_S
    """Seconds between two reads of the cluster's room."""
    retry_backoff_s: float = 1.0
    """Delay before attempt n+1 of a run: n × this (its request waits on the bus, put back with that
    delay: no compute slot is held while it waits)."""
    workdir_root: str | None = None
    """Where case workdirs are made (default: the system temp folder)."""
    worker_idle_s: float = WORKER_IDLE_S
    """Seconds a warm worker (`harness.kind: worker`) waits idle for its batch's next case before it
    is retired (a worker serves one batch)."""
    replica_id: str | None = None
    """This replica's id in marks, samples and the `dispatchers` bucket (default `<node>-<pid>`)."""
    sample_interval_s: float = SAMPLE_INTERVAL_S
    """Seconds between two placement samples of a running harness."""
    live_keep_settled_s: float = 120.0
    """Seconds a settled run's output stays on the LIVE stream after its `case.executed` is stored;
    then this replica purges it (`live_purge.py`) and its log is answered from the event store.
    Negative: never purged (the stream's 15-minute max age alone)."""
    status_interval_s: float = STATUS_INTERVAL_S
    """Seconds between two writes of the replica's status when nothing changes."""
    terminal_ping_s: float = TERMINAL_PING_S
    """Seconds between a live terminal's keep-alives (a client silent for three is gone)."""
    backend: Literal["local", "kubernetes", "nomad", "docker"] = "local"
    """Where cases run: this machine, a Kubernetes Job, a Nomad batch job or a Docker container per case
    attempt (docs/backends.md)."""
    namespace: str = "evalbus"
    """Kubernetes namespace the case Jobs are made in."""
    image: str = "evalbus/case:latest"
    """Case image when the harness names none (`harness.compute.image`); it runs the in-job runner."""
    kubeconfig: str | None = None
    """Kubeconfig file (`DISPATCHER_KUBECONFIG`, then `KUBECONFIG`); none: in-cluster, else `~/.kube/config`."""
    kube_context: str | None = None
    """Kubeconfig context (none: its current context)."""
    cluster_poll_s: float = 1.0
    """Seconds between two reads of a starting or running pod and its events."""
    start_timeout_s: float = 600.0
    """How long a case's pod or allocation may stay unscheduled or starting before the run fails."""
    artifact_hold_s: float = 120.0
    """Kubernetes: the longest a finished case's pod is held for its declared files to be read (0:
    never held; docs/backends.md, "The Kubernetes hold")."""
    nomad_addr: str = "http://127.0.0.1:4646"
    """Nomad's HTTP API (`DISPATCHER_NOMAD_ADDR`, then `NOMAD_ADDR`)."""
    nomad_token: str | None = None
    """Nomad ACL token (`DISPATCHER_NOMAD_TOKEN`, then `NOMAD_TOKEN`); redacted in logs."""
    nomad_namespace: str = "default"
    """Nomad namespace of the case jobs."""
    nomad_driver: Literal["docker", "raw_exec", "exec"] = "docker"
    """Task driver of the case jobs (`docker` runs the case image)."""
    nomad_variables_prefix: str = "evalbus/secrets"
    """Nomad Variables path a harness's secret name is read under (`<prefix>/<name>`, item `value`)."""
    docker_host: str = "unix:///var/run/docker.sock"
    """The Docker engine (`DISPATCHER_DOCKER_HOST`, then `DOCKER_HOST`): `unix:///path` or `tcp://host:port`."""
    docker_tls_verify: bool = False
    """TLS to a `tcp://` engine, its certificate checked against `ca.pem` in `docker_cert_path`
    (`DISPATCHER_DOCKER_TLS_VERIFY`, then `DOCKER_TLS_VERIFY`, as the docker CLI reads it)."""
    docker_tls: bool = False
    """TLS to a `tcp://` engine without checking its certificate (`DOCKER_TLS`); prefer `docker_tls_verify`."""
    docker_cert_path: str = ""
    """Folder of `ca.pem`, `cert.pem`, `key.pem` (`DOCKER_CERT_PATH`; empty: `~/.docker`)."""
    docker_api_version: str = "1.43"
    """Engine API version the requests are prefixed with (`/v1.43/…`)."""
    docker_network: str = "bridge"
    """Network mode of the case containers: `bridge`, `none`, `host` or a network's name."""
    lanes: str = DEFAULT_LANE
    """Lanes whose cases this replica takes, comma-separated (`DISPATCHER_LANES=gpu`,
    `default,nomad-eu`): a consumer per lane, shared by every replica serving it; each lane served
    gets the replica's `slots` (docs/backends.md, "Lanes")."""
    cancellations: Literal["follow", "lookup"] = "follow"
    """How it learns that a batch was cancelled: `follow` every `batch.cancelled` (an ordered
    consumer), or `lookup` the batch's when one of its cases arrives (one read per case; what a
    lane credential allows, `evalbus lane credential`)."""
    fanout: bool | None = None
    """Whether this replica fans batches out into cases (`dispatcher-batches`); unset: when it
    serves the default lane, so a GPU box or a laptop joining for its own lane does only its cases."""
    runner_nats_url: str = ""
    """On a cluster backend, the NATS URL as reachable from inside the case jobs: their runners publish
    the live log and trace there themselves (empty: off, the dispatcher relays them from the job log).
    No password in it: the URL is in every job spec."""
    runner_nats_secret: str = ""
    """Gone (refused when set): the runners' shared NATS password, which let a harness that read its
    runner's environment publish the live view of any run. They log in with run tokens now
    (`runner_auth_url`, `runner_auth_seed`; docs/deploy.md, "Secrets")."""
    runner_auth_url: str = ""
    """The NATS URL, credentials included, of the `runner-auth` user (the `AUTH` account of
    deploy/nats/accounts.conf): this replica answers the server's authorization requests there
    (`evalbus_dispatcher.runner_auth`); redacted in logs."""
    runner_auth_seed: str = ""
    """The seed (`SA…`) of the account nkey whose public key the server's `$NATS_RUNNER_ISSUER`
    holds (`evalbus runner-key`): with it each job's runner gets a token for its own run only —
    publish that run's live log and trace until the job's longest life is over, nothing else;
    redacted in logs."""

    def __post_init__(self) -> None:
        if self.artifact_hold_s < 0:
            raise ValueError(f"DISPATCHER_ARTIFACT_HOLD_S: at least 0, not {self.artifact_hold_s}")
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"DISPATCHER_SLOTS: at least 1, not {self.slots}")
        if self.runner_nats_url:
            parts = urlsplit(self.runner_nats_url)
            if parts.scheme not in ("nats", "tls", "ws", "wss") or not parts.hostname:
                raise ValueError(f"DISPATCHER_RUNNER_NATS_URL: a nats:// or tls:// URL, not {self.runner_nats_url!r}")
            if parts.password:
                raise ValueError(
                    "DISPATCHER_RUNNER_NATS_URL: no password in the URL (it is in every job spec); the runners log "
                    "in with run tokens (DISPATCHER_RUNNER_AUTH_URL, DISPATCHER_RUNNER_AUTH_SEED)"
                )
        if self.runner_nats_secret:
            raise ValueError(
                "DISPATCHER_RUNNER_NATS_SECRET: the runners' shared NATS password is gone; they log in with run "
                "tokens (DISPATCHER_RUNNER_AUTH_URL and DISPATCHER_RUNNER_AUTH_SEED, docs/deploy.md, 'Secrets')"
            )
        if bool(self.runner_auth_url) != bool(self.runner_auth_seed):
            missing = "DISPATCHER_RUNNER_AUTH_SEED" if self.runner_auth_url else "DISPATCHER_RUNNER_AUTH_URL"
            raise ValueError(f"{missing}: needed with the other (run tokens are minted and checked by the same key)")
        if self.runner_auth_seed:
            try:
                AccountKey.from_seed(self.runner_auth_seed)
            except ValueError as e:
                raise ValueError(f"DISPATCHER_RUNNER_AUTH_SEED: {e}") from None
        for lane in self.served_lanes():
            problem = lane_problem(lane)
            if problem is not None:
                raise ValueError(f"DISPATCHER_LANES: {lane!r}: {problem}")

    def runner_nats(self) -> RunnerNats | None:
        """Where the runners publish the live view themselves (None: off)."""
        if not self.runner_nats_url:
            return None
        tokens = RunTokens(AccountKey.from_seed(self.runner_auth_seed).token_key()) if self.runner_auth_seed else None
        return RunnerNats(url=self.runner_nats_url, tokens=tokens)

    def slot_count(self) -> int:
        """`slots`, or its default for the backend."""
        if self.slots is not None:
            return self.slots
        return (os.cpu_count() or 2) if self.backend == "local" else CLUSTER_SLOTS

    def served_lanes(self) -> tuple[str, ...]:
        """`lanes` as a list, in order, without repeats (empty: the default lane)."""
        names = [part.strip() for part in self.lanes.split(",") if part.strip()]
        return tuple(dict.fromkeys(names)) or (DEFAULT_LANE,)

    def fans_out(self) -> bool:
        """Whether it reads `dispatcher-batches`."""
        return self.fanout if self.fanout is not None else DEFAULT_LANE in self.served_lanes()


def kubernetes_backend(settings: DispatcherSettings, live: LiveHandoffs | None = None) -> KubernetesBackend:
    """The Kubernetes backend the settings describe (reads the kubeconfig); `live`: the executions
    whose runners may publish the live view themselves (`DISPATCHER_RUNNER_NATS_URL`)."""
    from evalbus_dispatcher.backends.kubernetes import JobTemplate, connect_cluster

    runner = settings.runner_nats()
    template = JobTemplate(namespace=settings.namespace, image=settings.image, start_timeout_s=settings.start_timeout_s,
                           runner_nats=runner, artifact_hold_s=settings.artifact_hold_s)  # fmt: skip
    return connect_cluster(
        template,
        kubeconfig=settings.kubeconfig,
        context=settings.kube_context,
        slots=settings.slot_count(),
        poll_s=settings.cluster_poll_s,
        live=live,
    )


def nomad_backend(settings: DispatcherSettings, live: LiveHandoffs | None = None) -> NomadBackend:
    """The Nomad backend the settings describe; `live` as for `kubernetes_backend`."""
    from evalbus_dispatcher.backends.nomad import NomadTemplate, connect_nomad

    runner = settings.runner_nats()
    template = NomadTemplate(
        image=settings.image,
        namespace=settings.nomad_namespace,
        driver=settings.nomad_driver,
        variables_prefix=settings.nomad_variables_prefix,
        start_timeout_s=settings.start_timeout_s,
        runner_nats=runner,
    )
    return connect_nomad(
        template,
        address=settings.nomad_addr,
        token_value=settings.nomad_token,
        slots=settings.slot_count(),
        poll_s=settings.cluster_poll_s,
        live=live,
    )


def docker_backend(
    settings: DispatcherSettings, secrets: SecretStore, live: LiveHandoffs | None = None
) -> DockerBackend:
    """The Docker backend the settings describe (secret values resolved from `secrets` at dispatch);
    `live` as for `kubernetes_backend`."""
    from evalbus_dispatcher.backends.docker import DockerTemplate, connect_docker

    template = DockerTemplate(image=settings.image, network=settings.docker_network,
                              start_timeout_s=settings.start_timeout_s, runner_nats=settings.runner_nats())  # fmt: skip
    return connect_docker(
        template,
        secrets,
        host=settings.docker_host,
        api_version=settings.docker_api_version,
        slots=settings.slot_count(),
        tls_verify=settings.docker_tls_verify,
        tls=settings.docker_tls,
        cert_path=Path(settings.docker_cert_path).expanduser() if settings.docker_cert_path else None,
        live=live,
    )


def observed(handle: SandboxHandle, mark: Mark) -> SandboxHandle:
    """`handle`, reporting its orchestrator's placement to the run's marks when it has one."""
    if is_observed(handle):
        handle.observe(mark)
    return handle


def build_dispatcher(service: Service, settings: DispatcherSettings) -> None:
    """Add the fan-out and execution stages to `service`."""
    secrets = SecretStore()
    backend = LocalBackend(
        slots=settings.slot_count(),
        root=None if settings.workdir_root is None else Path(settings.workdir_root),
        secrets=secrets,
        worker_idle_s=settings.worker_idle_s,
    )
    cluster: KubernetesBackend | NomadBackend | DockerBackend | None = None
    handoffs = LiveHandoffs()
    if settings.backend == "kubernetes":
        cluster = kubernetes_backend(settings, handoffs)
    elif settings.backend == "nomad":
        cluster = nomad_backend(settings, handoffs)
    elif settings.backend == "docker":
        cluster = docker_backend(settings, secrets, handoffs)
    puller = PlatformTracePuller(secrets)
    cancels = Cancellations(settings.cancellations)
    lanes = settings.served_lanes()
    most = settings.slot_count()
    pool = SlotPool(most, name="compute slots")
    presence = Presence(
        settings.replica_id or default_replica_id(),
        slots=most,
        interval_s=settings.status_interval_s,
        lanes=lanes,
    )
    room = (
        ClusterRoom(cluster, pool, most=most, interval_s=settings.room_interval_s, on_size=presence.resize)
        if cluster is not None and settings.slots_from_room
        else None
    )
    controls = LiveControls(ping_s=settings.terminal_ping_s)
    screens = ScreenSessions()
    runner_auth: list[RunnerAuth] = []
    purger: list[LivePurger] = []
    purges = purge_counter(service.metrics.registry)

    def settled(run_id: str, execution: str | None, delivery: Delivery) -> None:
        """Purge the run's live output once its `case.executed` is on the stream, and kept a while."""
        if purger:
            target = purger[0]
            delivery.on_published(lambda: target.settled(run_id, execution))

    async def start(svc: Service) -> None:
        swept = await asyncio.to_thread(sweep_orphans, backend.root)
        if swept:
            log.warning("removed %d sandboxes left by a dispatcher that died", len(swept))
        await puller.start()
        await cancels.start(svc.js)
        if room is not None:
            await room.start()
        await presence.start(svc.js)
        if settings.live_keep_settled_s >= 0:
            purger.append(LivePurger(svc.js, keep_s=settings.live_keep_settled_s, holds=presence.holds, purges=purges))
            purger[0].start()
        controls.bind(svc.nc)
        await screens.start()
        if settings.runner_auth_url:
            # its own connection: the `runner-auth` user is alone in the AUTH account
            nc = await connect(settings.runner_auth_url, f"{settings.service}-runner-auth")
            auth = RunnerAuth(nc, AccountKey.from_seed(settings.runner_auth_seed), registry=svc.metrics.registry)
            await auth.start()
            runner_auth.append(auth)

    async def stop(_: Service) -> None:
        for p in purger:
            await p.stop()
        purger.clear()
        for auth in runner_auth:
            await auth.close()
        await controls.close()
        await screens.close()
        if room is not None:
            await room.stop()
        await presence.stop()
        await puller.close()
        await backend.close()  # the warm workers
        if cluster is not None:
            await cluster.close()

    async def on_batch(event: BatchRequested, _: Delivery) -> Sequence[EventBase]:
        if event.rejudge_of is not None:
            return []  # a re-judge replays executed cases; nothing runs again
        try:
            return await fan_out_batch(service.js, event)
        except ValueError as e:
            raise Poison(f"batch.requested cannot be fanned out: {e}") from e

    def settled_execution(req: Any) -> Sequence[EventKey]:
        """A redelivered request was executed already when its `case.executed` or its next
        attempt's request is stored: the agent does not run a second time."""
        if not isinstance(req, CaseRequested):
            return ()
        retry = next_attempt(req)
        executed = stage_output_key(subjects.CASE_EXECUTED, req)
        return (*(() if executed is None else (executed,)), (retry.subject(), retry.msg_id()))

    async def on_case(req: CaseRequested, delivery: Delivery) -> Sequence[EventBase]:
        try:
            run_id_of(req)
        except ValueError as e:
            raise Poison(f"case.requested without a run: {e}") from e
        reason = await cancels.reason(service.js, req.batch_id)
        if reason is not None:
            settled(run_id_of(req), None, delivery)
            return [cancelled_execution(req, reason)]
        backoff = settings.retry_backoff_s * (req.attempt - 1)
        if backoff > 0 and delivery.num_delivered == 1:
            # A retry waits its backoff on the bus, not in a compute slot: put back, redelivered then.
            words = f"attempt {req.attempt} waits {backoff:g}s after a retryable failure"
            await LiveBus(service.publisher, req).infra([Infra(scope="placement", event="waiting", message=words)])
            raise Retry(words, delay_s=backoff)
        live = LiveBus(service.publisher, req)
        if req.attempt > 1 or delivery.num_delivered > 1:
            await live.resume(service.js)
        run_id = run_id_of(req)
        waited = max(0.0, (time.time_ns() - delivery.stored_ns) / 1e9) if delivery.stored_ns else 0.0

        held = True

        def free_slot() -> None:
            nonlocal held
            if held:
                held = False
                presence.free(run_id)

        def released() -> None:
            free_slot()
            delivery.release_slot()

        objects = RunObjects(service.js, settings.payload_inline_max_bytes, int(service.nc.max_payload or 0))
        presence.hold(run_id)
        try:
            with handoffs.holding(run_id, live):
                executed = await execute_case(
                    req,
                    cluster or backend,
                    live=live,
                    on_release=released,
                    trace_puller=puller,
                    dispatcher=presence.id,
                    queued=Queued(
                        waited_s=waited,
                        delivery=delivery.num_delivered,
                        lane=req.lane,
                        attempt=req.attempt,
                        backoff_s=backoff,
                    ),
                    sample_interval_s=settings.sample_interval_s,
                    on_sandbox=lambda handle, mark, declared: controls.attach(
                        run_id, observed(handle, mark), mark, screen=lambda: capture(screens.session, handle, declared)
                    ),
                    objects=objects,
                )
        finally:
            free_slot()
        if should_retry(executed, req.attempt, req.plan.retries):
            log.info("retrying %s after a retryable %s failure", executed.run_id, executed.result.failure)
            return [next_attempt(req)]
        settled(run_id, live.execution, delivery)
        return [executed]

    service.on_start(start)
    service.on_stop(stop)
    if settings.fans_out():
        service.add_stage(
            Stage(
                consumer=DISPATCHER_BATCHES, handler=on_batch, accepts=(BatchRequested,), concurrency=8, exclusive=True
            )
        )
    for lane in lanes:
        service.add_stage(
            Stage(
                consumer=lane_consumer(lane),
                handler=on_case,
                accepts=(CaseRequested,),
                concurrency=most,
                pool=pool,
                settled_by=settled_execution,
                exclusive=True,  # an agent never runs twice at once, whatever the ack wait
            )
        )
