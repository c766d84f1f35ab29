"""The gateway's own exceptions (one root; the HTTP edge translates them)."""

from __future__ import annotations


class GatewayError(Exception):
    """Root of the gateway's exceptions."""


class NotReadyError(GatewayError):
    """A resource opened at start-up (the database pool) is not open (yet, or any more)."""


class TokensFileError(GatewayError):
    """The tokens file cannot be read or does not have the documented shape."""
