"""Typed settings read once from the environment: `<SERVICE>_<KEY>` first, then the shared `<KEY>`.

Fields named in `SECRET_FIELDS` are redacted in `repr` and in logs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import msgspec

S = TypeVar("S", bound="ServiceSettings")


class SettingsError(ValueError):
    """An environment value that does not fit its setting."""


class ServiceSettings(msgspec.Struct, kw_only=True):
    """Settings every service has. Subclass to add a service's own."""

    SECRET_FIELDS: ClassVar[frozenset[str]] = frozenset({"database_url"})

    service: str = "evalbus"
    """Service name (metrics, logs, DLQ subject)."""
    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL(s), comma-separated for a cluster."""
    database_url: str | None = None
    """PostgreSQL URL (only the gateway uses it)."""
    http_host: str = "127.0.0.1"
    """Address of the health / metrics HTTP server."""
    http_port: int = 0
    """Port of the health / metrics HTTP server (0: any free port)."""
    log_level: str = "INFO"
    """Logging level."""
    log_format: str = "json"
    """`json` or `text`."""
    concurrency: int = 16
    """Messages handled at once per replica (per stage)."""
    shutdown_timeout_s: float = 30.0
    """Grace period for in-flight work on SIGTERM."""
    otel_exporter_otlp_endpoint: str | None = None
    """OTLP/HTTP endpoint for the service's own spans (unset: spans are not exported)."""
    state_dir: str | None = None
    """Local folder for the service's files (`EVALBUS_STATE_DIR`)."""
    ack_wait_s: float | None = None
    """`ack_wait` of the consumers this service reads, seconds (unset: each consumer's contract
    default, 30 or 60 s): how long a message a dead replica held waits before it is redelivered.
    Healthy replicas send `in_progress` every third of it, so a short value is safe while the
    event loop keeps running."""
    stream_replicas: int = 1
    """Replicas of the streams and buckets this service creates (3 on a 3-node NATS cluster); an
    existing stream's replica count is never lowered."""
    inbox_prefix: str = "_INBOX"
    """Prefix of the subjects replies come to (JetStream answers, pulled messages): a lane
    dispatcher's credential may subscribe only to `_INBOX.lane-<lane>.>`, so it cannot hear the
    messages other replicas pull."""
    create_topology: bool = True
    """Create (or update) the streams and buckets at start; false: take them as an operator or the
    other services created them (a lane dispatcher whose scoped credential may not change them)."""
    payload_inline_max_bytes: int = 256 * 1024
    """Largest answer + trace + snapshot (encoded JSON), and largest log, an event carries inline;
    above it they go to the `artifacts` object store bucket and the event names them
    (`evalbus_runtime.payloads`). Must stay well under the bus's `max_payload`."""
    fault_kill: str | None = None
    """TEST ONLY: deterministic SIGKILL points, `<point>:<consumer>:<event type>:<run id>[;…]`
    (see `evalbus_runtime.faults`). Never set in a deployment."""

    def __repr__(self) -> str:
        fields = []
        for name in self.__struct_fields__:
            value = getattr(self, name)
            shown = "'**********'" if name in self.SECRET_FIELDS and value is not None else repr(value)
            fields.append(f"{name}={shown}")
        return f"{type(self).__name__}({', '.join(fields)})"

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict for logs, secrets replaced."""
        return {
            name: (
                "**********" if name in self.SECRET_FIELDS and getattr(self, name) is not None else getattr(self, name)
            )
            for name in self.__struct_fields__
        }


_ALIASES = {"state_dir": ("EVALBUS_STATE_DIR",)}


def load_settings(cls: type[S], service: str, environ: Mapping[str, str] | None = None) -> S:
    """Build `cls` for `service` from the environment (service prefix first, then the shared key)."""
    env = os.environ if environ is None else environ
    prefix = service.upper().replace("-", "_") + "_"
    raw: dict[str, Any] = {"service": service}
    for name in cls.__struct_fields__:
        if name == "service":
            continue
        key = name.upper()
        for candidate in (prefix + key, key, *_ALIASES.get(name, ())):
            if candidate in env:
                raw[name] = env[candidate]
                break
    try:
        return msgspec.convert(raw, cls, strict=False)
    except msgspec.ValidationError as e:
        raise SettingsError(f"{service}: {e}") from e
