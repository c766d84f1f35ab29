"""The exceptions of `evalbus_traces`: one root, translated at the edge with `from e`.

A pull either returns events, returns nothing yet (`[]`, the flush-lag shape the collector
retries), or raises one of these hard errors, which are never retried. A secret the reference
names but the store lacks raises `evalbus_runtime.secrets.MissingSecretError` unchanged, so the
caller can record it as an unmeasured `missing_secret` instead of pulling unauthenticated.
"""

from __future__ import annotations

from evalbus_runtime.secrets import MissingSecretError


class TraceError(Exception):
    """Root of every error raised by this package."""


class TraceSourceError(TraceError):
    """A pull failed conclusively (a hard error: retrying an empty pull would not help)."""


class TraceUnavailableError(TraceSourceError):
    """The platform could not be reached or answered with a server error."""


class TraceRejectedError(TraceSourceError):
    """The platform refused the request (bad credentials, a malformed query: a 4xx other than 404)."""


class TraceConfigError(TraceSourceError):
    """The trace reference cannot be pulled as written (e.g. tag correlation without a scope)."""


__all__ = [
    "MissingSecretError",
    "TraceConfigError",
    "TraceError",
    "TraceRejectedError",
    "TraceSourceError",
    "TraceUnavailableError",
]
