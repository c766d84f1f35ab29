"""JSON logs carrying the run / batch ids and the trace id of the message being handled (via
contextvars), so a log line leads to the run's trace and back."""

from __future__ import annotations

import contextvars
import logging
import sys
from datetime import UTC, datetime

import msgspec

from evalbus_runtime.tracing import current_trace_id

run_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("run_id", default=None)
batch_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("batch_id", default=None)

_encoder = msgspec.json.Encoder()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message, run/batch/trace ids, error."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        run_id = run_id_var.get()
        if run_id:
            doc["run_id"] = run_id
        batch_id = batch_id_var.get()
        if batch_id:
            doc["batch_id"] = batch_id
        trace_id = current_trace_id()
        if trace_id:
            doc["trace_id"] = trace_id
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            doc.update(extra)
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return _encoder.encode(doc).decode()


def configure_logging(service: str, level: str = "INFO", fmt: str = "json") -> None:
    """Route the root logger to stderr in the chosen format (called once by the service runner)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("nats").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
