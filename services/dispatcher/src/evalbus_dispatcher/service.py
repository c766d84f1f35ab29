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

import aiohttp
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from evalbus_contracts import (
    DEFAULT_LANE,
    BatchCancelled,
    BatchRequested,
    CaseRequested,
    DecodeError,
    Infra,
    InfraMark,
    LiveLog,
    LivePlacement,
    LiveTrace,
    PlacementSample,
    TraceEvent,
    TraceRef,
    decode_event,
    lane_consumer,
    lane_problem,
    new_event_id,
    subjects,
)
from evalbus_contracts.control import TERMINAL_PING_S
from evalbus_contracts.events import EventBase, EventKey, stage_output_key
from evalbus_contracts.streams import CASES, DISPATCHER_BATCHES, LIVE
from evalbus_dispatcher.artifacts import RunObjects
from evalbus_dispatcher.backends.base import Mark, SandboxHandle, is_observed
from evalbus_dispatcher.backends.job_spec import LiveHandoffs, RunnerNats
from evalbus_dispatcher.backends.local import LocalBackend, sweep_orphans
from evalbus_dispatcher.cancellation import cancelled_execution
from evalbus_dispatcher.capacity import ROOM_INTERVAL_S, ClusterRoom
from evalbus_dispatcher.control import LiveControls
from evalbus_dispatcher.execute import Queued, execute_case, run_id_of
from evalbus_dispatcher.fanout import fan_out_batch
from evalbus_dispatcher.placement import SAMPLE_INTERVAL_S
from evalbus_dispatcher.presence import STATUS_INTERVAL_S, Presence, default_replica_id
from evalbus_dispatcher.retry import next_attempt, should_retry
from evalbus_dispatcher.runner_auth import RunnerAuth, RunTokens
from evalbus_dispatcher.screen import capture
from evalbus_runtime import (
    Delivery,
    MissingSecretError,
    Poison,
    Publisher,
    SecretStore,
    Service,
    ServiceSettings,
    SlotPool,
    Stage,
    connect,
)
from evalbus_runtime.nkeys import AccountKey
from evalbus_traces import build_source, collect_trace
from evalbus_traces.errors import TraceUnavailableError

if TYPE_CHECKING:
    # A cluster backend's module (the Kubernetes client above all: 0.7 s of a start on two cores)
    # is imported only by a dispatcher that uses it.
    from evalbus_dispatcher.backends.docker import DockerBackend
    from evalbus_dispatcher.backends.kubernetes import KubernetesBackend
    from evalbus_dispatcher.backends.nomad import NomadBackend

log = logging.getLogger("evalbus.dispatcher")

CancelReason = Literal["cancelled", "superseded"]

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
    """Delay before attempt n+1 of a run: n × this."""
    workdir_root: str | None = None
    """Where case workdirs are made (default: the system temp folder)."""
    replica_id: str | None = None
    """This replica's id in marks, samples and the `dispatchers` bucket (default `<node>-<pid>`)."""
    sample_interval_s: float = SAMPLE_INTERVAL_S
    """Seconds between two placement samples of a running harness."""
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
    (`runner_auth_url`, `runner_auth_seed`; docs/deploy.md, "Upgrading")."""
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
                "tokens (DISPATCHER_RUNNER_AUTH_URL and DISPATCHER_RUNNER_AUTH_SEED, docs/deploy.md, 'Upgrading')"
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


class LiveBus:
    """A running case's live output onto the LIVE stream (`run.<run>.live.*`), best effort: published
    without waiting for acknowledgements (the sealed trace in `case.executed` is the record).

    Each execution gets an id of its own (in every message id, so a redelivered attempt's messages
    are not taken for duplicates of the first one's); trace events go one per message (the
    stream's 2,000-message ring is then 2,000 events); log chunks carry their byte `offset` in the
    run's whole live log, continued from the log already on the stream (`resume`)."""

    def __init__(self, publisher: Publisher, req: CaseRequested) -> None:
        self._pub = publisher
        self._req = req
        self._run_id = run_id_of(req)
        self._execution = new_event_id()[:16]
        self._seq = {"stdout": 0, "stderr": 0, "trace": 0, "infra": 0, "placement": 0}
        self._t0 = time.monotonic()
        self._by_runner = False
        self.offset = 0
        """Bytes of the run's live log published so far (where the next chunk starts)."""

    @property
    def execution(self) -> str:
        """This execution's id (in every message)."""
        return self._execution

    @property
    def by_runner(self) -> bool:
        """Whether the job's runner publishes the live log and trace itself (this bus then does not)."""
        return self._by_runner

    def clock(self) -> float:
        """Seconds since this execution began (about the run's clock: it began just before)."""
        return time.monotonic() - self._t0

    def runner_publishes(self) -> None:
        """The runner said it publishes the live log and trace itself (`started` with `live: nats`):
        relaying them too would show every line twice."""
        self._by_runner = True

    def _next(self, channel: str) -> int:
        self._seq[channel] += 1
        return self._seq[channel]

    async def resume(self, js: JetStreamContext) -> None:
        """Continue the run's log offsets after what an earlier attempt or execution left on the
        stream (best effort: without it the offsets restart and only the tail search degrades)."""
        try:
            raw = await js.get_last_msg(LIVE.name, subjects.live_subject(self._run_id, "log"))
            last = decode_event(raw.data or b"")
        except nats.js.errors.NotFoundError:
            return
        except (nats.errors.Error, DecodeError) as e:
            log.warning("live log of %s not continued: %s", self._run_id, e)
            return
        if isinstance(last, LiveLog):
            self.offset = last.offset + len(last.text.encode("utf-8"))

    async def log(self, stream: Literal["stdout", "stderr"], text: str) -> None:
        if self._by_runner:
            return
        req = self._req
        chunk = LiveLog(
            batch_id=req.batch_id,
            case_id=req.case_id,
            run_id=self._run_id,
            attempt=req.attempt,
            execution=self._execution,
            seq=self._next(stream),
            stream=stream,
            text=text,
            offset=self.offset,
        )
        self.offset += len(text.encode("utf-8"))
        await self._pub.publish_nowait(chunk)

    async def trace(self, events: Sequence[TraceEvent]) -> None:
        if self._by_runner:
            return
        req = self._req
        for event in events:
            await self._pub.publish_nowait(
                LiveTrace(
                    batch_id=req.batch_id,
                    case_id=req.case_id,
                    run_id=self._run_id,
                    attempt=req.attempt,
                    execution=self._execution,
                    seq=self._next("trace"),
                    events=(event,),
                )
            )

    async def infra(self, mark: Infra) -> None:
        req = self._req
        await self._pub.publish_nowait(
            InfraMark(
                batch_id=req.batch_id,
                case_id=req.case_id,
                run_id=self._run_id,
                attempt=req.attempt,
                execution=self._execution,
                seq=self._next("infra"),
                mark=mark,
            )
        )

    async def placement(self, sample: PlacementSample) -> None:
        req = self._req
        await self._pub.publish_nowait(
            LivePlacement(
                batch_id=req.batch_id,
                case_id=req.case_id,
                run_id=self._run_id,
                attempt=req.attempt,
                execution=self._execution,
                seq=self._next("placement"),
                sample=sample,
            )
        )


class PlatformTracePuller:
    """Job-mode collection: the harness's platform trace through an `evalbus_traces` source.

    An empty pull is retried (flush lag) and, still empty, gives the `error` event naming the
    correlation key; a hard error raises `TraceUnavailableError` (a retryable collect failure); a
    secret the reference names but the store lacks raises `MissingSecretError` — nothing was sent,
    and `execute_case` records the observation graders as `unmeasured: missing_secret`.
    """

    def __init__(self, secrets: SecretStore) -> None:
        self._secrets = secrets
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def pull(self, ref: TraceRef) -> list[TraceEvent]:
        assert self._session is not None
        outcome = await collect_trace(build_source(ref, self._secrets, self._session), ref)
        if outcome.status == "missing_secret":
            raise MissingSecretError(outcome.missing_secret or ref.auth_secret or "")
        if outcome.status == "unavailable":
            raise TraceUnavailableError(outcome.error or outcome.status)
        events = list(outcome.events)
        if outcome.error_event is not None:
            events.append(outcome.error_event)
        return events


class ScreenSessions:
    """The HTTP session screen captures talk to harnesses' browsers with (open while the service runs)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the service is not started")
        return self._session

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class Cancellations:
    """Which batches are cancelled or superseded, from `batch.cancelled.*` (last per batch): followed
    by an ordered consumer, or (`lookup`) read per batch when one of its cases arrives — a lane
    dispatcher's user may not create an unfiltered consumer on CASES, which could re-filter another
    lane's durable consumer."""

    def __init__(self, mode: Literal["follow", "lookup"] = "follow") -> None:
        self._mode = mode
        self._reasons: dict[str, CancelReason] = {}
        self._read = 0

    async def reason(self, js: JetStreamContext, batch_id: str | None) -> CancelReason | None:
        """Why the batch stopped starting cases, or None while it has not."""
        if batch_id is None:
            return None
        known = self._reasons.get(batch_id)
        if known is not None or self._mode == "follow":
            return known
        try:
            raw = await js.get_last_msg(CASES.name, subjects.batch_subject(subjects.BATCH_CANCELLED, batch_id))
        except nats.js.errors.NotFoundError:
            return None
        try:
            event = decode_event(raw.data or b"")
        except DecodeError:
            log.warning("unreadable cancellation of %s ignored", batch_id)
            return None
        if isinstance(event, BatchCancelled):
            self._reasons[batch_id] = event.reason  # a cancellation is final
            return event.reason
        return None

    async def start(self, js: JetStreamContext) -> None:
        """Follow cancellations; return once every cancellation already stored has been read (in
        `lookup` mode: nothing to do)."""
        if self._mode == "lookup":
            return
        info = await js.stream_info("CASES", subjects_filter="batch.cancelled.>")
        known = len(info.state.subjects or {})

        caught_up = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            try:
                event = decode_event(msg.data)
            except DecodeError:
                log.warning("unreadable cancellation on %s ignored", msg.subject)
            else:
                if isinstance(event, BatchCancelled) and event.batch_id:
                    self._reasons[event.batch_id] = event.reason
            self._read += 1  # one per subject, readable or not
            if self._read >= known:
                caught_up.set()

        await js.subscribe(
            "batch.cancelled.>", cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
        )
        if known == 0:
            return
        try:
            await asyncio.wait_for(caught_up.wait(), 5.0)
        except TimeoutError:
            log.warning("read %d of %d cancellations at start", self._read, known)


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

    async def start(svc: Service) -> None:
        swept = await asyncio.to_thread(sweep_orphans, backend.root)
        if swept:
            log.warning("removed %d sandboxes left by a dispatcher that died", len(swept))
        await puller.start()
        await cancels.start(svc.js)
        if room is not None:
            await room.start()
        await presence.start(svc.js)
        controls.bind(svc.nc)
        await screens.start()
        if settings.runner_auth_url:
            # its own connection: the `runner-auth` user is alone in the AUTH account
            nc = await connect(settings.runner_auth_url, f"{settings.service}-runner-auth")
            auth = RunnerAuth(nc, AccountKey.from_seed(settings.runner_auth_seed), registry=svc.metrics.registry)
            await auth.start()
            runner_auth.append(auth)

    async def stop(_: Service) -> None:
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
            return [cancelled_execution(req, reason)]
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
                    backoff_s=settings.retry_backoff_s * (req.attempt - 1),
                    dispatcher=presence.id,
                    queued=Queued(waited_s=waited, delivery=delivery.num_delivered, lane=req.lane),
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
        return [executed]

    service.on_start(start)
    service.on_stop(stop)
    if settings.fans_out():
        service.add_stage(
            Stage(consumer=DISPATCHER_BATCHES, handler=on_batch, accepts=(BatchRequested,), concurrency=8)
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
            )
        )
