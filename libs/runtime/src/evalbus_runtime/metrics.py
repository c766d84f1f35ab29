"""Prometheus metrics of a service, in a registry of its own (several services can share a process in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServiceMetrics:
    """The chassis' metrics: messages by outcome, handler time, in-flight work, dead letters."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["consumer"]
        self.messages = Counter(
            "evalbus_messages_total",
            "Messages handled, by outcome (ack, ignored, retry, poison, cancelled, held)",
            [*labels, "outcome"],
            registry=self.registry,
        )
        self.handle_seconds = Histogram(
            "evalbus_handle_seconds",
            "Time from delivery to ack",
            labels,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
        self.in_flight = Gauge("evalbus_in_flight", "Messages being handled", labels, registry=self.registry)
        self.slots_free = Gauge("evalbus_slots_free", "Free handler slots", labels, registry=self.registry)
        self.dead_letters = Counter(
            "evalbus_dead_letters_total", "Messages copied to the DLQ", [*labels, "reason"], registry=self.registry
        )
        self.published = Counter(
            "evalbus_published_total", "Events published and acknowledged", ["type"], registry=self.registry
        )
        self.info = Gauge("evalbus_service_info", "Service identity", ["service"], registry=self.registry)
        self.info.labels(service=service).set(1)
