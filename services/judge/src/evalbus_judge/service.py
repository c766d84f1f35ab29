"""Wiring of the judge service: the `judge-cases` consumer (global limit = its `max_ack_pending`)
feeding ready cases to `judge_ready`, the shared HTTP client's and the spend ledger's lifecycle."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import msgspec
from nats.js import JetStreamContext
from prometheus_client import Counter

from evalbus_contracts import CaseCollected, CaseExecuted, CaseObserved
from evalbus_contracts.events import EventBase
from evalbus_contracts.streams import JUDGE_CASES
from evalbus_contracts.subjects import CASE_JUDGED
from evalbus_judge.apply import ReadyEvent, judge_ready, observation_retry_delay, unreadable_payload
from evalbus_judge.budget import BudgetUnavailableError, SpendLedger
from evalbus_judge.chat import ChatClient
from evalbus_judge.limits import ProviderLimits
from evalbus_judge.registry import JudgeRegistry, ModelDefaults
from evalbus_runtime import Delivery, Poison, Retry, Service, ServiceSettings, Stage, settled_by_output
from evalbus_runtime.objects import ObjectReadError, ObjectStoreError
from evalbus_runtime.payloads import keep_offloaded, load_result, unreadable


async def load_ready(js: JetStreamContext, event: ReadyEvent) -> ReadyEvent:
    """`event` with its result's offloaded parts loaded and verified (itself when nothing is
    offloaded, or when it is a `case.executed` the collector still completes)."""
    if event.result.payload is None or (isinstance(event, CaseExecuted) and not event.trace_complete):
        return event
    return msgspec.structs.replace(event, result=await load_result(js, event.result))


class JudgeSettings(ServiceSettings):
    """Settings of the judge service (`JUDGE_<KEY>`, then `<KEY>`)."""

    concurrency: int = 64
    """Cases judged at once by one replica (a case waiting for a provider's slot holds one)."""
    model_base_url: str | None = None
    """Default OpenAI-compatible endpoint for model judges that name none."""
    model_api_key_secret: str | None = None
    """Secret name of the default endpoint's API key."""
    allowed_base_urls: str | None = None
    """Comma-separated base URLs, besides the default, that model judges may send a named secret to."""
    global_limit: int = 32
    """Most model calls in flight to one provider (base URL + model) across ALL replicas: the
    ceiling of its adaptive limit (`limits.py`), which starts at 4 and adapts to the provider."""
    max_in_flight: int = 512
    """Cases in flight across ALL replicas (the consumer's max_ack_pending): rule judges run at
    this, not at a provider's limit."""
    plugins: str | None = None
    """Comma-separated `module:function` entries, each called with the registry at start to register
    custom judges by name (referenced from specs as `kind: registered`)."""


def load_plugins(registry: JudgeRegistry, plugins: str | None) -> None:
    """Call every `module:function` in `plugins` with the registry."""
    for entry in filter(None, (p.strip() for p in (plugins or "").split(","))):
        module_name, _, attr = entry.partition(":")
        if not attr:
            raise ValueError(f"judge plugin {entry!r} must be module:function")
        register = getattr(importlib.import_module(module_name), attr)
        register(registry)


def build_judge(service: Service, settings: JudgeSettings, registry: JudgeRegistry | None = None) -> JudgeRegistry:
    """Add the judge stage to `service`; returns the registry (tests register custom judges on it)."""
    limits = ProviderLimits(ceiling=settings.global_limit, registry=service.metrics.registry)
    chat = ChatClient(limits=limits)
    reg = registry or JudgeRegistry(
        chat=chat,
        model_defaults=ModelDefaults(
            base_url=settings.model_base_url,
            api_key_secret=settings.model_api_key_secret,
            allowed_base_urls=tuple(u.strip() for u in (settings.allowed_base_urls or "").split(",") if u.strip()),
        ),
    )

    load_plugins(reg, settings.plugins)
    spend = SpendLedger()
    fates = Counter(
        "evalbus_online_fates_total",
        "Observation fates decided by this replica (the judge decides `skipped: over_budget`), by suite, fate "
        "and reason (GET /v1/online/stats has the exact counts)",
        ["suite", "fate", "reason"],
        registry=service.metrics.registry,
    )

    async def start(svc: Service) -> None:
        await chat.start()
        await spend.start(svc.js, svc.settings.stream_replicas)
        await limits.start(svc.js, svc.settings.stream_replicas)

    async def stop(_: Service) -> None:
        await chat.close()
        await limits.close()

    consumer = msgspec.structs.replace(JUDGE_CASES, max_ack_pending=settings.max_in_flight)

    async def handle(event: ReadyEvent, delivery: Delivery) -> Sequence[EventBase]:
        try:
            loaded = await load_ready(service.js, event)
        except ObjectReadError as e:
            raise Retry(f"the run's payload could not be read yet: {e}") from e
        except ObjectStoreError as e:  # tampered, replaced, gone or too large: never judged on other bytes
            try:
                tampered = unreadable_payload(event, unreadable(e))
            except ValueError as bad:
                raise Poison(str(bad)) from bad
            return [] if tampered is None else [tampered]
        try:
            outcome = await judge_ready(loaded, reg, spend=spend)
        except ValueError as e:
            raise Poison(str(e)) from e
        except BudgetUnavailableError as e:
            raise Retry(f"the suite's spend could not be read: {e}") from e
        judged = outcome.judged
        if judged is not None and loaded is not event:
            judged = msgspec.structs.replace(judged, result=keep_offloaded(judged.result, event.result))
        for fate in outcome.fates:
            fates.labels(fate.suite_id or "-", fate.fate, fate.reason).inc()
        delay = observation_retry_delay(
            event, judged, num_delivered=delivery.num_delivered, max_deliver=consumer.max_deliver
        )
        if delay is not None:
            raise Retry(f"a judge could not score the observation yet (retryable); again in {delay:g} s", delay)
        return [*outcome.fates, *([] if judged is None else [judged])]

    service.on_start(start)
    service.on_stop(stop)
    service.add_stage(
        Stage(
            consumer=consumer,
            handler=handle,
            accepts=(CaseExecuted, CaseCollected, CaseObserved),
            concurrency=settings.concurrency,
            settled_by=settled_by_output(CASE_JUDGED),  # a redelivered case judged already costs no LLM call
            exclusive=True,  # never two at once: a stalled replica is not joined on its case
        )
    )
    return reg
