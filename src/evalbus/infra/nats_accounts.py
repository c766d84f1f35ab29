"""Least-privilege NATS users of evalbus, as data, and the `accounts.conf` they render to — for
the deployments (`deploy/nats/accounts.conf`) and for the local stack (`evalbus up --secure`).

    python deploy/nats/accounts.py            # rewrite deploy/nats/accounts.conf
    python deploy/nats/accounts.py --check    # exit 1 when the committed file is stale

Every service gets its own user in the `EVALBUS` account. What a user may publish and subscribe
is derived from what the service's code does on the bus (`docs/deploy.md`, "NATS users"):

* the subjects of the events it produces (`evalbus_contracts.subjects`, each event's `subject()`),
  and `dlq.<service>` for its dead letters;
* for each durable pull consumer it reads (`evalbus_contracts.streams`): create it
  (`$JS.API.CONSUMER.DURABLE.CREATE.<stream>.<durable>`), pull from it
  (`$JS.API.CONSUMER.MSG.NEXT...`), acknowledge (`$JS.ACK.<stream>.<durable>.>`), hear its
  exhausted deliveries (`$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES...`) and read the exhausted
  message back (`$JS.API.STREAM.MSG.GET.<stream>`) to dead-letter it, and hold its messages and
  probe a redelivery's holder (`held.<stream>.<durable>.*`, an exclusive stage's);
* for each stream it reads outside its consumers (projections kept by an ordered consumer, last
  messages read by subject): ephemeral consumers, flow-control replies and message reads on that
  stream only;
* the topology every service creates idempotently at start (`Service.start` ->
  `ensure_topology`): create, update and read the info of each stream and key-value bucket;
* `_INBOX.>` for every reply (JetStream API answers, pulled messages, PubAcks).

`tests/test_deploy.py` checks this table against `evalbus_contracts.streams` (every consumer is
granted to the service that reads it, every stream and bucket is in the topology) and that the
committed `accounts.conf` is what `render()` writes; `nats-server -t` parses the result.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

ACCOUNT = "EVALBUS"
"""The account every evalbus user belongs to (KEDA's scaler and the exporter name it)."""

TOPOLOGY: tuple[str, ...] = (
    "CASES",
    "LIVE",
    "OBSERVATIONS",
    "DLQ",
    "KV_dispatchers",
    "KV_terminal-tickets",
    "KV_supersede-keys",
    "OBJ_datasets",
    "OBJ_artifacts",
)
"""Streams (a key-value bucket is the stream `KV_<bucket>`, an object store bucket `OBJ_<bucket>`)
that any service may create at start."""


@dataclass(frozen=True)
class Grant:
    """One subject a user may use, and why."""

    subject: str
    why: str


@dataclass(frozen=True)
class ServiceUser:
    """What one service does on the bus."""

    name: str
    consumers: tuple[tuple[str, str], ...]
    """(stream, durable) of each durable pull consumer the service reads."""
    publishes: tuple[Grant, ...]
    """Event subjects it produces (its dead-letter subject is added)."""
    reads: tuple[str, ...] = ()
    """Streams it reads outside its consumers: ordered consumers and last-message reads."""
    subscribes: tuple[Grant, ...] = ()
    """Core NATS subjects it subscribes to (request/reply, terminals)."""
    direct_gets: tuple[str, ...] = ()
    """Streams it reads with direct gets (key-value `get`)."""
    responds: bool = False
    """Whether it answers requests (`allow_responses`: publish once to each request's reply)."""
    finds_streams: bool = False
    """Whether it subscribes without naming the stream (`$JS.API.STREAM.NAMES` lookup)."""
    publish_extra: tuple[Grant, ...] = field(default=())
    """Other subjects it publishes (key-value writes, terminal output)."""
    own_streams: tuple[str, ...] = ()
    """Streams only this service creates and reads (a key-value bucket of its own)."""


SERVICES: tuple[ServiceUser, ...] = (
    ServiceUser(
        name="gateway",
        consumers=(("CASES", "gateway-recorder"),),
        publishes=(
            Grant("batch.requested.>", "POST /v1/batches (BatchRequested)"),
            Grant("batch.cancelled.>", "cancel and supersede (BatchCancelled)"),
            Grant("batch.finalized.>", "finalisation (BatchFinalized)"),
            Grant("case.executed.>", "re-judge replays a batch's executed cases (CaseExecuted)"),
            Grant("case.collected.>", "re-judge replays a batch's collected cases (CaseCollected)"),
            Grant("online.suite.>", "online suites applied and deleted (OnlineSuiteApplied/Deleted)"),
            Grant("suite.baseline.>", "suite baselines set (SuiteBaselineSet)"),
        ),
        reads=("CASES", "LIVE", "KV_dispatchers", "KV_terminal-tickets", "KV_supersede-keys", "OBJ_datasets"),
        subscribes=(Grant("term.*.out", "terminal output from the dispatcher holding the run"),),
        direct_gets=("KV_dispatchers", "KV_terminal-tickets", "KV_supersede-keys"),
        finds_streams=True,
        publish_extra=(
            Grant("ctl.*.*", "actions on a live sandbox, requests to the dispatcher (subjects.control_subject)"),
            Grant("term.*.in", "terminal keystrokes to the dispatcher (subjects.terminal_subject)"),
            Grant("$KV.terminal-tickets.>", "single-use terminal tickets (streams.TERMINAL_TICKETS)"),
            Grant("$KV.supersede-keys.>", "the latest batch of each supersede key (streams.SUPERSEDE_KEYS)"),
            Grant("$O.datasets.>", "uploaded datasets: chunks and meta (POST /v1/datasets, streams.DATASETS)"),
            Grant("$JS.API.STREAM.PURGE.OBJ_datasets", "the chunks of a refused or replaced upload"),
            Grant("$JS.API.STREAM.PURGE.CASES", "stream compaction: a finalized batch's events, once all are recorded"),
            Grant(
                "$JS.API.CONSUMER.INFO.CASES.*",
                "a queued run's placement: requests its lane's queue (dispatcher-cases[-<lane>]) has not delivered yet",
            ),
        ),
    ),
    ServiceUser(
        name="dispatcher",
        consumers=(("CASES", "dispatcher-batches"), ("CASES", "dispatcher-cases")),
        publishes=(
            Grant("case.requested.>", "fan-out and retries (CaseRequested)"),
            Grant("case.executed.>", "executed cases (CaseExecuted)"),
            Grant("run.*.live.>", "live log, trace, infra marks and placement (LiveLog, LiveTrace, ...)"),
        ),
        reads=("CASES", "LIVE", "OBJ_datasets"),
        subscribes=(
            Grant("ctl.*.*", "actions on the live sandboxes it holds (subjects.control_filter)"),
            Grant("term.*.in", "terminal keystrokes (subjects.terminal_subject)"),
        ),
        responds=True,
        finds_streams=True,
        publish_extra=(
            Grant("$KV.dispatchers.>", "its presence in the dispatchers bucket (streams.DISPATCHERS)"),
            Grant("term.*.out", "terminal output (subjects.terminal_subject)"),
            Grant("$JS.API.STREAM.PURGE.LIVE", "a settled run's live output, once kept a while (live_purge.py)"),
        ),
    ),
    ServiceUser(
        name="collector",
        responds=True,  # answers probes of the messages it holds (Stage.exclusive)
        consumers=(
            ("CASES", "collector-cases"),
            ("OBSERVATIONS", "collector-observations"),
            ("OBSERVATIONS", "collector-spans"),
            ("DLQ", "collector-dead-letters"),
        ),
        publishes=(
            Grant("case.collected.>", "completed control-plane cases (CaseCollected)"),
            Grant("case.observed.>", "sampled production traces (CaseObserved)"),
            Grant("online.fate.>", "the fate of every observation (ObservationFate)"),
            Grant("obs.spans.>", "OTLP span batches stored before the request is answered (ObservationSpans)"),
            Grant("obs.received.>", "assembled traces (ObservationReceived)"),
        ),
        reads=("CASES",),
        finds_streams=True,
        direct_gets=("KV_ONLINE_RATES", "KV_ONLINE_TRACES"),
        publish_extra=(
            Grant("$KV.ONLINE_RATES.>", "online suites' rate caps, counted across replicas (online/rates.py)"),
            Grant("$KV.ONLINE_TRACES.>", "assembled traces, recorded for every replica (online/trace_store.py)"),
        ),
        own_streams=("KV_ONLINE_RATES", "KV_ONLINE_TRACES"),
    ),
    ServiceUser(
        name="judge",
        responds=True,  # answers probes of the messages it holds (Stage.exclusive)
        consumers=(("CASES", "judge-cases"),),
        publishes=(
            Grant("case.judged.>", "judged cases (CaseJudged)"),
            Grant("online.fate.>", "observations over their suite's daily budget (ObservationFate)"),
        ),
        direct_gets=("KV_ONLINE_SPEND", "KV_JUDGE_LIMITS"),
        publish_extra=(
            Grant("$KV.ONLINE_SPEND.>", "online suites' daily model-judge spend, counted across replicas (budget.py)"),
            Grant("$KV.JUDGE_LIMITS.>", "model providers' adaptive concurrency, shared by the replicas (limits.py)"),
        ),
        own_streams=("KV_ONLINE_SPEND", "KV_JUDGE_LIMITS"),
    ),
    ServiceUser(
        name="exporter",
        responds=True,  # answers probes of the messages it holds (Stage.exclusive)
        consumers=(("CASES", "exporter-cases"),),
        publishes=(Grant("case.exported.>", "exported cases (CaseExported)"),),
    ),
)


# ---------------------------------------------------------------- the in-job runner

AUTH_ACCOUNT = "AUTH"
"""The account of the runners' credential check (nats-server's auth callout): only its responder
is in it, so no evalbus user can hear the requests, which hold what each client connected with."""
RUNNER_AUTH_USER = "runner-auth"
"""The dispatchers' user in `AUTH_ACCOUNT`: it answers `$SYS.REQ.USER.AUTH`
(`evalbus_dispatcher.runner_auth`, `DISPATCHER_RUNNER_AUTH_URL`)."""
ISSUER_VARIABLE = "NATS_RUNNER_ISSUER"
"""The environment variable nats-server reads the callout's issuer from: the public account nkey
(`A…`) whose seed only the dispatchers hold (`DISPATCHER_RUNNER_AUTH_SEED`, `evalbus runner-key`)."""


def render_runner_auth() -> tuple[list[str], list[str], list[str]]:
    """The runner-auth user's permissions block, the `AUTH` account and the `authorization` block
    that sends every client which is no static user to the dispatchers' callout."""
    permissions = [
        "RUNNER_AUTH_PERMISSIONS = {",
        "  publish: {",
        "    deny: [",
        '      ">"  # nothing but the answer to each request',
        "    ]",
        "  }",
        "  subscribe: {",
        "    allow: [",
        "      \"$SYS.REQ.USER.AUTH\"  # the server's authorization requests (the runners' run tokens)",
        "    ]",
        "  }",
        "  # publish once to the reply subject of each request received (the signed answer)",
        "  allow_responses: true",
        "}",
        "",
    ]
    account = [
        "  # The dispatchers' answer to the runners' run tokens (nats-server's auth callout): a run",
        "  # token becomes a user in EVALBUS that may publish its run's live log and trace until the",
        "  # token's expiry, nothing else. Alone in its account, so no evalbus user hears the requests.",
        f"  {AUTH_ACCOUNT}: {{",
        "    users: [",
        f"      {{user: {RUNNER_AUTH_USER}, password: ${password_variable(RUNNER_AUTH_USER)}, "
        "permissions: $RUNNER_AUTH_PERMISSIONS}",
        "    ]",
        "  }",
    ]
    authorization = [
        "# Clients that are no user above (the in-job runners, with a run token) are asked about to the",
        f"# {RUNNER_AUTH_USER} user; a static user keeps its password (its account is not in allowed_accounts).",
        "authorization: {",
        "  auth_callout: {",
        f"    issuer: ${ISSUER_VARIABLE}  # the public account nkey the answers are signed with",
        f"    account: {AUTH_ACCOUNT}",
        f"    auth_users: [{RUNNER_AUTH_USER}]",
        f"    allowed_accounts: [{AUTH_ACCOUNT}]",
        "  }",
        "}",
        "",
    ]
    return permissions, account, authorization


# ---------------------------------------------------------------- lanes

LANE_USER_PREFIX = "lane-"
"""A lane dispatcher's user is `lane-<lane>` (`evalbus lane credential LANE`)."""


def lane_user(lane: str) -> str:
    """The NATS user of the dispatchers serving `lane` on machines of their own."""
    return LANE_USER_PREFIX + lane


def lane_inbox(lane: str) -> str:
    """The reply prefix a lane dispatcher connects with (`DISPATCHER_INBOX_PREFIX`): its user may
    subscribe to these inboxes only, never to the ones other clients pull messages into."""
    return f"_INBOX.{lane_user(lane)}"


def lane_durable(lane: str) -> str:
    """The lane's shared consumer (`evalbus_contracts.streams.lane_consumer`)."""
    return "dispatcher-cases" if lane == "default" else f"dispatcher-cases-{lane}"


def lane_filter(lane: str) -> str:
    """The lane's requests (`evalbus_contracts.subjects.lane_filter`)."""
    return "case.requested.*.*" if lane == "default" else f"case.requested.*.*.{lane}"


def lane_publish_grants(lane: str) -> list[Grant]:
    """What a dispatcher serving only `lane` may publish: its lane's consumer (created with its
    filter pinned, pulled, acknowledged), reads of the streams, and what a dispatcher produces —
    never another lane's consumer, a stream's definition or a batch."""
    durable, pinned = lane_durable(lane), lane_filter(lane)
    why = f"consumer {durable}"
    grants = [Grant(f"$JS.API.STREAM.INFO.{stream}", "streams and buckets looked up at start") for stream in TOPOLOGY]
    grants += [
        Grant(f"$JS.API.CONSUMER.CREATE.CASES.{durable}.{pinned}", why + ", only with the lane's filter"),
        Grant(f"$JS.API.CONSUMER.INFO.CASES.{durable}", why),
        Grant(f"$JS.API.CONSUMER.MSG.NEXT.CASES.{durable}", why),
        Grant(f"$JS.ACK.CASES.{durable}.>", why + ": ack, nak, in_progress, term"),
        # No unfiltered `$JS.API.CONSUMER.CREATE.CASES`: through it a user may update any durable
        # consumer of CASES by name (another lane's filter); it reads cancellations per batch instead.
        Grant(
            "$JS.API.STREAM.MSG.GET.CASES",
            "a batch's cancellation (DISPATCHER_CANCELLATIONS=lookup), dead letters, a redelivery's stored outputs",
        ),
        Grant("$JS.API.STREAM.MSG.GET.LIVE", "a retried run's live log offset"),
        Grant(pinned, "retries of its lane's cases (CaseRequested)"),
        Grant("case.executed.>", "executed cases (CaseExecuted)"),
        Grant("run.*.live.>", "live log, trace, infra marks and placement (LiveLog, LiveTrace, ...)"),
        Grant("dlq.dispatcher", "its dead letters (DeadLetter)"),
        Grant("$KV.dispatchers.>", "its presence in the dispatchers bucket, with the lanes it serves"),
        Grant("term.*.out", "terminal output (subjects.terminal_subject)"),
        Grant(f"held.CASES.{durable}.*", "probes: is a redelivered request still held (Stage.exclusive)"),
    ]
    return grants


def lane_subscribe_grants(lane: str) -> list[Grant]:
    """What a dispatcher serving only `lane` may subscribe to."""
    return [
        Grant(f"{lane_inbox(lane)}.>", "its own replies only (DISPATCHER_INBOX_PREFIX)"),
        Grant(
            f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.CASES.{lane_durable(lane)}",
            f"exhausted {lane_durable(lane)} deliveries",
        ),
        Grant("ctl.*.*", "actions on the live sandboxes it holds (subjects.control_filter)"),
        Grant("term.*.in", "terminal keystrokes (subjects.terminal_subject)"),
        Grant(f"held.CASES.{lane_durable(lane)}.*", "the requests it holds, answering probes (Stage.exclusive)"),
    ]


def lane_permissions_name(lane: str) -> str:
    """The name of the lane user's permissions block in `accounts.conf`."""
    return password_variable(lane_user(lane)).removeprefix("NATS_PASSWORD_") + "_PERMISSIONS"


def render_lane_permissions(lane: str) -> list[str]:
    """The lane user's permissions block."""
    lines = [f"{lane_permissions_name(lane)} = {{", "  publish: {", "    allow: ["]
    lines += _grant_lines(lane_publish_grants(lane), "      ")
    lines += ["    ]", "  }", "  subscribe: {", "    allow: ["]
    lines += _grant_lines(lane_subscribe_grants(lane), "      ")
    lines += ["    ]", "  }", "  # publish once to the reply subject of each request received (ctl.<run>.<action>)"]
    lines += ["  allow_responses: true", "}", ""]
    return lines


def render_lane_user(lane: str, password: str | None = None) -> str:
    """The lane user's entry in the account's `users`: its password from
    `$NATS_PASSWORD_LANE_<LANE>`, or the given one (the local stack's file, mode 0600)."""
    secret = f'"{password}"' if password is not None else f"${password_variable(lane_user(lane))}"
    return f"{{user: {lane_user(lane)}, password: {secret}, permissions: ${lane_permissions_name(lane)}}}"


def password_variable(user: str) -> str:
    """The environment variable nats-server reads a user's password from."""
    return "NATS_PASSWORD_" + user.upper().replace("-", "_")


def publish_grants(user: ServiceUser) -> list[Grant]:
    """Everything `user` may publish."""
    grants: list[Grant] = []
    for stream in TOPOLOGY:
        for verb in ("CREATE", "UPDATE", "INFO"):
            grants.append(Grant(f"$JS.API.STREAM.{verb}.{stream}", "topology created at start"))
    for stream in user.own_streams:
        for verb in ("CREATE", "UPDATE", "INFO"):
            grants.append(Grant(f"$JS.API.STREAM.{verb}.{stream}", "a bucket of its own, created at start"))
        grants.append(Grant(f"$JS.API.STREAM.MSG.GET.{stream}", "key-value reads"))
    if user.finds_streams:
        grants.append(Grant("$JS.API.STREAM.NAMES", "stream lookup by subject (js.subscribe without a stream)"))
    get_streams: list[str] = []
    for stream, durable in user.consumers:
        why = f"consumer {durable}"
        grants += [
            Grant(f"$JS.API.CONSUMER.CREATE.{stream}.{durable}", why + ", created by name (several filters)"),
            Grant(f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.>", why + ", created by name with its filter"),
            Grant(f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}", why + " (releases before named creation)"),
            Grant(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}", why),
            Grant(f"$JS.API.CONSUMER.INFO.{stream}.{durable}", why + ": its ack_wait, read back"),
            Grant(f"$JS.ACK.{stream}.{durable}.>", why + ": ack, nak, in_progress, term"),
            Grant(f"held.{stream}.{durable}.*", why + ": is a redelivered message still held (Stage.exclusive)"),
        ]
        if stream not in get_streams:
            get_streams.append(stream)
    for stream in user.reads:
        grants += [
            Grant(f"$JS.API.CONSUMER.CREATE.{stream}", f"ordered consumers on {stream}"),
            Grant(f"$JS.FC.{stream}.>", f"flow control of ordered consumers on {stream}"),
        ]
        if stream not in get_streams:
            get_streams.append(stream)
    for stream in get_streams:
        grants.append(
            Grant(
                f"$JS.API.STREAM.MSG.GET.{stream}",
                "dead-lettering exhausted messages, last reads, a redelivery's stored outputs",
            )
        )
    for stream in user.direct_gets:
        grants.append(Grant(f"$JS.API.DIRECT.GET.{stream}.>", "key-value reads"))
    grants += list(user.publishes)
    grants.append(Grant(f"dlq.{user.name}", "its dead letters (DeadLetter)"))
    grants += list(user.publish_extra)
    return grants


def subscribe_grants(user: ServiceUser) -> list[Grant]:
    """Everything `user` may subscribe to."""
    grants = [Grant("_INBOX.>", "replies: JetStream API answers, pulled messages, PubAcks")]
    for stream, durable in user.consumers:
        grants.append(
            Grant(f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}", f"exhausted {durable} deliveries")
        )
        grants.append(Grant(f"held.{stream}.{durable}.*", f"the {durable} messages it holds (Stage.exclusive)"))
    grants += list(user.subscribes)
    return grants


def _quoted(subject: str) -> str:
    return '"' + subject + '"'


def _grant_lines(grants: list[Grant], indent: str) -> list[str]:
    width = max(len(_quoted(g.subject)) for g in grants)
    return [f"{indent}{_quoted(g.subject).ljust(width)}  # {g.why}" for g in grants]


def render(lanes: dict[str, str | None] | None = None) -> str:
    """The text of `accounts.conf`, with a user for each lane of `lanes` (lane -> its password, or
    None to read it from `$NATS_PASSWORD_LANE_<LANE>`)."""
    lanes = lanes or {}
    auth_permissions, auth_account, authorization = render_runner_auth()
    lines = [
        "# GENERATED by deploy/nats/accounts.py from the table of what each service does on the bus in",
        "# src/evalbus/infra/nats_accounts.py; edit that table, then run `python deploy/nats/accounts.py`",
        "# (tests/test_deploy_nats.py checks both).",
        "#",
        "# One account for evalbus with JetStream, one user per service (least privilege: each may",
        "# publish only what it produces and subscribe only to what it consumes, plus its own",
        "# JetStream API calls), an `admin` user for operators and the evalbus CLI, an `ingest` user",
        "# for applications that send observations (the Python Recorder), the system account, and a",
        "# credential check for the in-job runners: each connects with its own run's token, checked",
        "# by the dispatchers (auth callout), and may publish only that run's live log and trace.",
        "# Passwords come from the environment (NATS_PASSWORD_<USER>), never from this file, and so",
        f"# does the callout's public key (${ISSUER_VARIABLE}).",
        "",
    ]
    for user in SERVICES:
        lines.append(f"{user.name.upper()}_PERMISSIONS = {{")
        lines.append("  publish: {")
        lines.append("    allow: [")
        lines += _grant_lines(publish_grants(user), "      ")
        lines.append("    ]")
        lines.append("  }")
        lines.append("  subscribe: {")
        lines.append("    allow: [")
        lines += _grant_lines(subscribe_grants(user), "      ")
        lines.append("    ]")
        lines.append("  }")
        if user.responds:
            lines.append("  # publish once to the reply subject of each request received (ctl.<run>.<action>)")
            lines.append("  allow_responses: true")
        lines.append("}")
        lines.append("")
    for lane in sorted(lanes):
        lines += render_lane_permissions(lane)
    lines += [
        "INGEST_PERMISSIONS = {",
        "  publish: {",
        "    allow: [",
        '      "obs.received.>"  # observations offered for online evaluation (evalbus.online.Recorder)',
        "    ]",
        "  }",
        "  subscribe: {",
        "    allow: [",
        '      "_INBOX.>"        # PubAcks',
        "    ]",
        "  }",
        "}",
        "",
        *auth_permissions,
        "accounts: {",
        f"  {ACCOUNT}: {{",
        "    jetstream: enabled",
        "    users: [",
    ]
    for user in SERVICES:
        lines.append(
            f"      {{user: {user.name}, password: ${password_variable(user.name)}, "
            f"permissions: ${user.name.upper()}_PERMISSIONS}}"
        )
    lines += [
        f"      {{user: ingest, password: ${password_variable('ingest')}, permissions: $INGEST_PERMISSIONS}}",
        *(f"      {render_lane_user(lane, lanes[lane])}" for lane in sorted(lanes)),
        "      # operators and the evalbus CLI (dlq, replay, status): everything in this account",
        f"      {{user: admin, password: ${password_variable('admin')}}}",
        "    ]",
        "  }",
        *auth_account,
        "  SYS: {",
        "    users: [",
        f"      {{user: sys, password: ${password_variable('sys')}}}",
        "    ]",
        "  }",
        "}",
        "system_account: SYS",
        "",
        *authorization,
    ]
    return "\n".join(lines)


def users() -> list[str]:
    """Every user `render()` defines."""
    return [u.name for u in SERVICES] + ["ingest", RUNNER_AUTH_USER, "admin", "sys"]


def main(target: Path, argv: list[str] | None = None) -> int:
    """Write (or `--check`) `target` (`deploy/nats/accounts.conf`)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when accounts.conf is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            sys.stderr.write(f"{target} is stale: run python deploy/nats/accounts.py\n")
            return 1
        return 0
    target.write_text(text, encoding="utf-8")
    return 0
