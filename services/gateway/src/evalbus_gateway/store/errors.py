"""Exceptions of the event store (one root, so the edges can translate them)."""

from __future__ import annotations


class StoreError(Exception):
    """Root of the event store's exceptions."""


class MigrationError(StoreError):
    """The migrations on disk disagree with the ones already applied."""


class BatchNotFoundError(StoreError):
    """No batch with this id was recorded."""
