"""Wire types of the HTTP API that are not store views (the client decodes them too).

Batches and runs are served as the store's read-model views (`evalbus_api.views.BatchView`,
`RunView`, `Trajectory`); these types wrap them in pages and carry what the API adds.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from evalbus_api.views import BatchStatus, BatchView, RunView
from evalbus_contracts import DatasetIndex, ObjectRef

Role = Literal["admin", "member"]
"""What a principal may do: `admin` everything, `member` only its own batches."""


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    """What went wrong with a request."""

    code: str
    """Stable machine code (`invalid`, `invalid_json`, `unauthorized`, `not_found`...)."""
    message: str
    """Human-readable explanation."""
    field: str | None = None
    """The offending input: a JSON path into the body (`$.suite.cases[0].id`), a query or path
    parameter name (`limit`, `batch_id`) or a header (`Authorization`); null when none applies."""


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """Every 4xx/5xx response body."""

    error: ErrorDetail
    """The error."""


class BatchLinks(msgspec.Struct, frozen=True, kw_only=True):
    """Where to follow a batch."""

    self_: str = msgspec.field(name="self")
    """The batch."""
    cases: str
    """Its cases, paginated."""
    events: str
    """Its events as server-sent events."""
    cancel: str
    """POST here to cancel it."""


class DatasetUploaded(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /v1/datasets`: the upload was checked and stored."""

    dataset_ref: ObjectRef
    """The reference a batch names the dataset by (`suite.dataset_ref`)."""
    index: DatasetIndex
    """What the gateway read in it: distinct cases and objective metrics."""


class BatchAccepted(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /v1/batches`: the batch was published as `batch.requested`."""

    batch_id: str
    """The minted batch id."""
    status: Literal["queued"] = "queued"
    """Always `queued`: the dispatcher picks it up from the bus."""
    links: BatchLinks
    """Where to follow it."""
    superseded: tuple[str, ...] = ()
    """Open batches with the same `supersede_key` that were cancelled as superseded by this one."""


class CancelRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Optional body of `POST /v1/batches/{batch_id}/cancel` (an empty body is the same)."""


class CancelAccepted(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /v1/batches/{batch_id}/cancel`: the batch starts no new case; in-flight ones settle."""

    batch_id: str
    """The batch."""
    status: Literal["cancelling"] = "cancelling"
    """The batch ends `cancelled` (or `superseded`) once its in-flight cases settle."""
    reason: Literal["cancelled", "superseded"] = "cancelled"
    """Why it stops (a batch superseded earlier keeps that reason)."""


class BatchPage(msgspec.Struct, frozen=True, kw_only=True):
    """One page of batches, newest first."""

    batches: tuple[BatchView, ...]
    """The batches."""
    next_cursor: str | None = None
    """Pass as `cursor` for the next page; null on the last page."""


class CasePage(msgspec.Struct, frozen=True, kw_only=True):
    """One page of a batch's runs (case × trial), by run id."""

    cases: tuple[RunView, ...]
    """Runs with their per-stage status, scores and verdict."""
    next_cursor: str | None = None
    """Pass as `cursor` for the next page; null on the last page."""


class Me(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /v1/me`: who the bearer token is."""

    principal: str
    """Principal name (the creator recorded on the batches it submits)."""
    role: Role
    """`admin` or `member`."""


IDEMPOTENCY_KEY_MAX = 200
"""The longest `Idempotency-Key` (of printable characters) a submission may carry."""


class StreamEnd(msgspec.Struct, frozen=True, kw_only=True):
    """Data of the SSE `end` event: the batch is finalized."""

    batch_id: str
    """The batch."""
    status: BatchStatus
    """Its final status."""


class Health(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /healthz` (the chassis): the process is up."""

    status: str
    """`ok`."""
    service: str
    """Service name."""


class Readiness(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /readyz` (the chassis): the service is connected and started."""

    status: Literal["ok", "unavailable"]
    """`ok`, or `unavailable` (503)."""
    checks: dict[str, bool | str]
    """Each check: true, false, or the error it raised."""
