"""Finalisation wiring: publish `batch.finalized` for batches the recorder found complete.

The aggregate itself is pure (`aggregate.build_finalized`) and read from the store by
`store.finalize_batch`; this module is the edge that publishes it. Calling it more than once is
safe: it publishes only when the stream has no `batch.finalized` of the batch yet
(`Publisher.publish_missing`, also after JetStream's duplicate window), two replicas racing are
inside that window (the event's `Nats-Msg-Id` is `batch.finalized:<batch>`), and the store keeps
only the first `batch.finalized` of a batch — so a redelivered message, two replicas, or the
start-up sweep can all call this for the same batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from evalbus_contracts import BatchFinalized
from evalbus_gateway.store import complete_unfinalized_batches, finalize_batch
from evalbus_runtime import Publisher

if TYPE_CHECKING:
    from evalbus_gateway.store.connections import Database

log = logging.getLogger("evalbus.gateway.finalize")


async def finalize_completed(db: Database, publisher: Publisher, batch_ids: Iterable[str]) -> list[BatchFinalized]:
    """Compute and publish `batch.finalized` for each complete batch; returns what was published.

    Raises the first error (a store or publish failure) after trying every batch, so the caller
    can retry: nothing is acknowledged as finalized unless JetStream stored it.
    """
    published: list[BatchFinalized] = []
    failure: Exception | None = None
    for batch_id in dict.fromkeys(batch_ids):
        try:
            event = await finalize_batch(db, batch_id)
            await publisher.publish_missing([event])
        except Exception as e:
            log.warning("finalizing %s failed: %s: %s", batch_id, type(e).__name__, e)
            failure = failure or e
            continue
        log.info("finalized %s: %s", batch_id, event.status)
        published.append(event)
    if failure is not None:
        raise failure
    return published


async def finalize_stragglers(db: Database, publisher: Publisher) -> list[BatchFinalized]:
    """The start-up sweep: finalize every complete batch that has no `batch.finalized` yet (one
    whose finalisation was lost between a commit and a publish, e.g. a crash)."""
    return await finalize_completed(db, publisher, await complete_unfinalized_batches(db))


class Resources(Protocol):
    """Where the database and the publisher come from once the service has started."""

    @property
    def pool(self) -> Database:
        """The database."""
        ...

    @property
    def publisher(self) -> Publisher:
        """The service's publisher."""
        ...


class Finalizer:
    """Single-flight finalisation inside one process: the handlers of every message of a
    complete batch wait for one shared publish instead of each computing the aggregate."""

    def __init__(self, resources: Resources) -> None:
        self._resources = resources
        self._running: dict[str, asyncio.Task[list[BatchFinalized]]] = {}

    async def finalize(self, batch_id: str) -> None:
        """Finalize `batch_id` (joining a finalisation already under way); raises if it failed."""
        task = self._running.get(batch_id)
        if task is None:
            task = asyncio.create_task(finalize_completed(self._resources.pool, self._resources.publisher, [batch_id]))
            self._running[batch_id] = task
            task.add_done_callback(lambda done: self._forget(batch_id, done))
        await asyncio.shield(task)

    def _forget(self, batch_id: str, task: asyncio.Task[list[BatchFinalized]]) -> None:
        if self._running.get(batch_id) is task:
            del self._running[batch_id]

    async def drain(self) -> None:
        """Wait for finalisations under way (at shutdown)."""
        if self._running:
            await asyncio.gather(*self._running.values(), return_exceptions=True)
