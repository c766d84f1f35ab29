"""The PostgreSQL event store: append-only events, sealed hash-chained trajectories, read models.

- `migrate`: versioned schema, safe to run from every replica at start.
- `record`: a batch of CASES messages in one transaction (events, read models, seals).
- `verify_run` / `verify_batch`: recompute seals (what `evalbus verify` runs).
- `queries`: the reads of the HTTP API (their views are `evalbus_api.views`), and `rebuild_read_models` (what `evalbus replay` runs).
- `finalize_batch`: the `batch.finalized` event of a complete batch.
"""

from evalbus_gateway.store.chain import canonical_bytes, chain
from evalbus_gateway.store.errors import BatchNotFoundError, MigrationError, StoreError
from evalbus_gateway.store.finalize import finalize_batch
from evalbus_gateway.store.migrate import migrate
from evalbus_gateway.store.queries import (
    RebuildOutcome,
    complete_unfinalized_batches,
    get_batch,
    get_batch_request,
    get_batch_spec,
    get_run,
    get_trajectory,
    list_runs,
    open_batches_by_supersede_key,
    rebuild_read_models,
)
from evalbus_gateway.store.recorder import RecordedMessage, RecordOutcome, record
from evalbus_gateway.store.verify import BatchVerifyResult, VerifyResult, verify_batch, verify_run

__all__ = [
    "BatchNotFoundError",
    "BatchVerifyResult",
    "MigrationError",
    "RebuildOutcome",
    "RecordOutcome",
    "RecordedMessage",
    "StoreError",
    "VerifyResult",
    "canonical_bytes",
    "chain",
    "complete_unfinalized_batches",
    "finalize_batch",
    "get_batch",
    "get_batch_request",
    "get_batch_spec",
    "get_run",
    "get_trajectory",
    "list_runs",
    "migrate",
    "open_batches_by_supersede_key",
    "rebuild_read_models",
    "record",
    "verify_batch",
    "verify_run",
]
