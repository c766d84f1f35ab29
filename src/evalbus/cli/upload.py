"""Large suites leave the batch: `evalbus run` uploads the resolved cases as a dataset.

A batch rides the bus as one `batch.requested` event, and a stock nats-server takes 1 MB a
message. So when the cases a suite resolved to encode to more than the inline limit
(`EVALBUS_INLINE_CASES_MAX_BYTES`, default 256 KiB), they are streamed to `POST /v1/datasets` as
JSONL — encoded a block at a time, with a progress bar on a terminal — and the batch names the
upload by `suite.dataset_ref` instead of carrying them. Nothing changes in the suite file.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TextIO

import msgspec

from evalbus.cli.progress import bar
from evalbus_api.client import GatewayClient
from evalbus_api.models import DatasetUploaded
from evalbus_contracts import BatchSpec, CaseSpec

INLINE_LIMIT_ENV = "EVALBUS_INLINE_CASES_MAX_BYTES"
"""Setting: the largest encoded inline cases `evalbus run` submits inside the batch."""
DEFAULT_INLINE_LIMIT = 256 * 1024
"""Default of `EVALBUS_INLINE_CASES_MAX_BYTES`: well under a stock nats-server's 1 MB message."""
_BLOCK_CASES = 500
_encoder = msgspec.json.Encoder()


class UploadSettingError(ValueError):
    """`EVALBUS_INLINE_CASES_MAX_BYTES` is not a number of bytes."""


def inline_limit(environ: Mapping[str, str] = os.environ) -> int:
    """`EVALBUS_INLINE_CASES_MAX_BYTES`, else the default (0: always upload)."""
    raw = environ.get(INLINE_LIMIT_ENV, "").strip()
    if not raw:
        return DEFAULT_INLINE_LIMIT
    try:
        value = int(raw)
    except ValueError:
        raise UploadSettingError(f"{INLINE_LIMIT_ENV} must be a number of bytes, got {raw!r}") from None
    if value < 0:
        raise UploadSettingError(f"{INLINE_LIMIT_ENV} must be 0 or more, got {value}")
    return value


def needs_upload(spec: BatchSpec, limit: int) -> bool:
    """Whether the spec's inline cases are too large to submit inline."""
    if spec.suite.dataset_ref is not None or not spec.suite.cases:
        return False
    return len(_encoder.encode(spec.suite.cases)) > limit


async def jsonl_blocks(cases: Sequence[CaseSpec], on_block: UploadProgress | None = None) -> AsyncIterator[bytes]:
    """The cases as JSONL, `_BLOCK_CASES` lines a block (never the whole file in one piece)."""
    buffer = bytearray()
    for start in range(0, len(cases), _BLOCK_CASES):
        buffer.clear()
        for case in cases[start : start + _BLOCK_CASES]:
            _encoder.encode_into(case, buffer, len(buffer))
            buffer += b"\n"
        block = bytes(buffer)
        if on_block is not None:
            on_block.sent(len(block), min(start + _BLOCK_CASES, len(cases)))
        yield block


class UploadProgress:
    """`uploading dataset [#####.....] 12.0 MB, 4,000/20,000 cases`, redrawn in place on a
    terminal; one summary line at the end either way."""

    def __init__(self, total_cases: int, out: TextIO = sys.stderr, *, quiet: bool = False) -> None:
        self.total_cases = total_cases
        self.out = out
        self.quiet = quiet
        self.tty = out.isatty()
        self.bytes = 0
        self.cases = 0
        self.started = time.monotonic()
        self._drawn = 0.0

    def sent(self, size: int, cases: int) -> None:
        """A block of `size` bytes holding the cases up to `cases` went out."""
        self.bytes += size
        self.cases = cases
        now = time.monotonic()
        if self.quiet or not self.tty or (now - self._drawn < 0.1 and cases < self.total_cases):
            return
        self._drawn = now
        line = f"uploading dataset {bar(cases, self.total_cases)} {self.bytes / 1e6:.1f} MB, "
        self.out.write(f"\r{line}{cases:,}/{self.total_cases:,} cases")
        self.out.flush()

    def done(self, uploaded: DatasetUploaded) -> None:
        """The upload was stored."""
        if self.quiet:
            return
        elapsed = time.monotonic() - self.started
        end = "\r\x1b[K" if self.tty else ""
        self.out.write(
            f"{end}uploaded dataset {uploaded.dataset_ref.name}: {uploaded.index.cases:,} cases, "
            f"{uploaded.dataset_ref.size / 1e6:.1f} MB in {elapsed:.1f} s\n"
        )
        self.out.flush()


async def offload_cases(client: GatewayClient, spec: BatchSpec, progress: UploadProgress) -> BatchSpec:
    """Upload the spec's inline cases as a dataset; the spec naming it instead."""
    uploaded = await client.upload_dataset(jsonl_blocks(spec.suite.cases, progress))
    progress.done(uploaded)
    suite = msgspec.structs.replace(spec.suite, cases=(), dataset_ref=uploaded.dataset_ref)
    return msgspec.structs.replace(spec, suite=suite)
