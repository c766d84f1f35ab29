"""The rules around uploading a suite's cases (pure): when `evalbus run` uploads, what the JSONL it
streams holds, and the settings that size it."""

from __future__ import annotations

import io

import msgspec
import pytest

from evalbus.cli.upload import (
    DEFAULT_INLINE_LIMIT,
    INLINE_LIMIT_ENV,
    UploadProgress,
    UploadSettingError,
    inline_limit,
    jsonl_blocks,
    needs_upload,
)
from evalbus.infra.nats import DEFAULT_MAX_PAYLOAD, MAX_PAYLOAD_ENV, max_payload_setting
from evalbus_contracts import BatchSpec, CaseSpec, CommandHarness, ObjectRef, SuiteSpec

pytestmark = pytest.mark.unit


def spec(n: int, size: int = 100) -> BatchSpec:
    cases = tuple(CaseSpec(id=f"c{i}", input="x" * size, expected=str(i)) for i in range(n))
    return BatchSpec(suite=SuiteSpec(id="s", cases=cases), harness=CommandHarness(id="h", command=("true",)))


def test_only_cases_over_the_inline_limit_are_uploaded() -> None:
    small, large = spec(10), spec(3000)
    assert not needs_upload(small, DEFAULT_INLINE_LIMIT)
    assert needs_upload(large, DEFAULT_INLINE_LIMIT)
    assert needs_upload(small, 0)
    ref = ObjectRef(bucket="datasets", name="ds-1", size=1, sha256="0" * 64)
    named = msgspec.structs.replace(large, suite=SuiteSpec(id="s", dataset_ref=ref))
    assert not needs_upload(named, 0)


async def test_the_jsonl_blocks_are_the_cases_line_by_line() -> None:
    cases = spec(1234, size=10).suite.cases
    out = io.StringIO()
    progress = UploadProgress(len(cases), out=out)
    blocks = [block async for block in jsonl_blocks(cases, progress)]
    assert len(blocks) == 3
    lines = b"".join(blocks).splitlines()
    assert [msgspec.json.decode(line, type=CaseSpec) for line in lines] == list(cases)
    assert (progress.cases, progress.bytes) == (1234, sum(len(b) for b in blocks))
    assert out.getvalue() == ""  # not a terminal: no bar, only the summary line at the end


def test_settings_are_checked() -> None:
    assert inline_limit({}) == DEFAULT_INLINE_LIMIT
    assert inline_limit({INLINE_LIMIT_ENV: "0"}) == 0
    with pytest.raises(UploadSettingError, match="must be a number of bytes, got 'lots'"):
        inline_limit({INLINE_LIMIT_ENV: "lots"})
    assert max_payload_setting({}) == DEFAULT_MAX_PAYLOAD
    assert max_payload_setting({MAX_PAYLOAD_ENV: "1048576"}) == 1024 * 1024
    with pytest.raises(ValueError, match="between 65536 and 67108864"):
        max_payload_setting({MAX_PAYLOAD_ENV: "100"})
