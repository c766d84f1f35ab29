"""The evalbus service chassis: settings, bus connection, consumer loop, dead letters, metrics,
tracing, health and shutdown — written once, used by all five services."""

from evalbus_runtime.bus import connect, ensure_topology
from evalbus_runtime.consumer import ConsumerLoop, Delivery, Handler, Stage, settled_by_output
from evalbus_runtime.errors import Poison, PublishFailedError, Retry, RuntimeFailure
from evalbus_runtime.metrics import ServiceMetrics
from evalbus_runtime.publisher import PubAck, Publisher
from evalbus_runtime.secrets import MissingSecretError, SecretStore, SecretValue
from evalbus_runtime.service import Service, run_service
from evalbus_runtime.settings import ServiceSettings, SettingsError, load_settings
from evalbus_runtime.slots import SlotPool

__all__ = [
    "ConsumerLoop",
    "Delivery",
    "Handler",
    "MissingSecretError",
    "Poison",
    "PubAck",
    "PublishFailedError",
    "Publisher",
    "Retry",
    "RuntimeFailure",
    "SecretStore",
    "SecretValue",
    "Service",
    "ServiceMetrics",
    "ServiceSettings",
    "SettingsError",
    "SlotPool",
    "Stage",
    "connect",
    "ensure_topology",
    "load_settings",
    "run_service",
    "settled_by_output",
]
