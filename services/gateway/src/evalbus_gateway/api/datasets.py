"""Datasets off the bus: `POST /v1/datasets` streams an upload into the `datasets` object store
bucket, and a batch names it by `suite.dataset_ref` instead of carrying its cases.

The upload is checked as it streams (`DatasetChecker`: every line, strictly, problems named by
line), so a dataset that is stored is a valid one; its index (case count, objective metrics) and
its uploader are kept in the object's meta. A batch naming a dataset is then checked against that
meta only — the uploader (another member's dataset answers exactly like a missing one), the size and
the SHA-256 its reference pins — and `batch.requested` carries the reference and the index, never
the cases. The dispatcher reads the cases from the object when it fans the batch out, checking the
digest again.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web
from nats.errors import Error as NatsError

from evalbus_api.models import DatasetUploaded
from evalbus_contracts import DatasetIndex, ObjectRef, SuiteSpec, decode, encode
from evalbus_contracts.streams import DATASETS
from evalbus_gateway.api.errors import ApiError
from evalbus_gateway.api.table import Body, Call, Link, Route
from evalbus_gateway.api.validation import DatasetChecker
from evalbus_runtime.objects import (
    ObjectMissingError,
    ObjectStoreError,
    nats_digest,
    object_headers,
    object_info,
    put_object,
)

log = logging.getLogger("evalbus.gateway.datasets")

UPLOADED_BY = "Evalbus-Uploaded-By"
"""Object meta header: the principal that uploaded the dataset."""
DATASET_INDEX = "Evalbus-Dataset-Index"
"""Object meta header: the dataset's `DatasetIndex` as JSON, written once every line was checked."""
_READ_CHUNK = 256 * 1024


def new_dataset_name() -> str:
    """A fresh object name: `ds-` + 24 hex digits (unguessable, subject-safe)."""
    return "ds-" + secrets.token_hex(12)


async def _request_chunks(request: web.Request, limit: int) -> AsyncIterator[bytes]:
    """The request body as it arrives; a 413 once it is (or is declared) larger than `limit`."""
    length = request.content_length
    if length is not None and length > limit:
        raise ApiError(413, "payload_too_large", f"dataset of {length} bytes exceeds {limit} bytes", "$")
    size = 0
    while True:
        chunk = await request.content.read(_READ_CHUNK)
        if not chunk:
            return
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "payload_too_large", f"dataset exceeds {limit} bytes", "$")
        yield chunk


async def upload_dataset(call: Call) -> web.StreamResponse:
    """POST /v1/datasets."""
    state = call.state
    checker = DatasetChecker()
    name = new_dataset_name()
    headers = {UPLOADED_BY: call.user.name}
    indexes: list[DatasetIndex] = []

    async def checked() -> AsyncIterator[bytes]:
        async for chunk in _request_chunks(call.request, state.settings.max_dataset_bytes):
            checker.feed(chunk)
            yield chunk
        # Raising here (a bad line) makes put_object purge the chunks: nothing invalid is kept.
        index = checker.finish()
        headers[DATASET_INDEX] = encode(index).decode()
        indexes.append(index)

    try:
        ref = await put_object(state.js, DATASETS, name, checked(), headers=headers)
    except (ObjectStoreError, NatsError) as e:
        raise ApiError(503, "unavailable", f"the dataset could not be stored: {e}", "$") from e
    index = indexes[0]
    log.info("dataset %s uploaded by %s: %d cases, %d bytes", name, call.user.name, index.cases, ref.size)
    return web.Response(
        status=201, body=encode(DatasetUploaded(dataset_ref=ref, index=index)), content_type="application/json"
    )


async def dataset_index_of(call: Call, ref: ObjectRef) -> DatasetIndex:
    """The index of the uploaded dataset `ref` names, once it is the caller's (or the caller is an
    admin) and its meta pins the same bytes; a 400 naming the field of `$.suite.dataset_ref` that is
    wrong otherwise."""
    at = "$.suite.dataset_ref"
    try:
        info = await object_info(call.state.js, ref)
    except ObjectMissingError:
        info = None
    headers = object_headers(info) if info is not None else {}
    owner = headers.get(UPLOADED_BY)
    if info is None or not call.user.may_access(owner):
        raise ApiError(400, "invalid", f"no uploaded dataset named {ref.name!r} (POST /v1/datasets)", f"{at}.name")
    if info.size != ref.size:
        raise ApiError(400, "invalid", f"the dataset is {info.size} bytes, not {ref.size}", f"{at}.size")
    if info.digest != nats_digest(ref.sha256):
        raise ApiError(400, "invalid", "the dataset's SHA-256 is not this one", f"{at}.sha256")
    raw = headers.get(DATASET_INDEX)
    if raw is None:
        raise ApiError(400, "invalid", f"object {ref.name!r} is not a dataset uploaded through /v1/datasets", at)
    return decode(raw.encode(), DatasetIndex)


async def with_dataset_index(call: Call, suite: SuiteSpec) -> SuiteSpec:
    """`suite` with the gateway's index of its uploaded dataset (a submitted index is replaced)."""
    if suite.dataset_ref is None:
        return msgspec.structs.replace(suite, dataset_index=None)
    index = await dataset_index_of(call, suite.dataset_ref)
    return msgspec.structs.replace(suite, dataset_index=index)


ROUTES: tuple[Route, ...] = (
    Route(
        ("POST",),
        "/v1/datasets",
        "uploadDataset",
        "Upload a dataset (JSONL of cases) for a batch to name",
        "member",
        upload_dataset,
        tag="datasets",
        description="The body is JSONL: one case (a `CaseSpec`: id, input, expected, graders…) per line, blank "
        "lines skipped, sent in one request of any size up to `GATEWAY_MAX_DATASET_BYTES` (chunked transfer "
        "encoding is fine). It streams into the `datasets` object store bucket while every line is checked "
        "strictly, like inline cases; a problem is a 400 naming its line and field (`line 7, $.graders[0].id`), "
        "and nothing is kept. The answer's `dataset_ref` goes in `suite.dataset_ref` of `POST /v1/batches` "
        "(only the uploader, or an admin, may name it).",
        request=Body("JSONL, one case per line", content_type="application/x-ndjson", schema={"type": "string"}),
        responses={
            201: Body(
                "Stored: the reference to name it by and what it holds",
                DatasetUploaded,
                links=(
                    Link(
                        "submitBatch",
                        "submitBatch",
                        request_body={"suite": {"dataset_ref": "$response.body#/dataset_ref"}},
                        description="A batch naming the dataset (`suite.dataset_ref`)",
                    ),
                ),
            ),
        },
    ),
)
