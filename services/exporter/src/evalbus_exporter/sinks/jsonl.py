"""The `jsonl` sink: one JSON line per case in a file, idempotent on redelivery.

The path a batch names is resolved inside the exporter's export folder (`EXPORTER_EXPORT_DIR`);
a path that leaves it (absolute elsewhere, `..`) fails the sink, since submitters do not choose
where the exporter writes.

Appends happen under an exclusive `flock`, after checking that the run id is not in the file yet,
so a redelivered case — by this replica or another on the same machine — is written once. The
run ids already in the file are cached with the offset read so far; only the new tail is scanned.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

import msgspec

from evalbus_contracts import CaseJudged, JsonlSink, Measured, SinkOutcome, utcnow


class JsonlLine(msgspec.Struct, frozen=True, kw_only=True):
    """One exported case."""

    batch_id: str | None
    case_id: str | None
    run_id: str
    trial: int | None
    status: str
    answer: str | None
    scores: dict[str, float]
    passed: dict[str, bool]
    failure: str | None
    exported_at: str


_encoder = msgspec.json.Encoder()


class _Index:
    def __init__(self) -> None:
        self.offset = 0
        self.run_ids: set[str] = set()


class JsonlCaseSink:
    """Writes judged cases to `spec.path` (`{batch}` replaced by the batch id)."""

    name = "jsonl"

    def __init__(self, spec: JsonlSink, batch_id: str, root: Path) -> None:
        self.root = root.resolve()
        self.path = (self.root / spec.path.replace("{batch}", batch_id)).resolve()
        self._index = _Index()
        self._lock = asyncio.Lock()

    async def export(self, judged: CaseJudged) -> SinkOutcome:
        if not self.path.is_relative_to(self.root):
            return SinkOutcome(
                sink=self.name, status="failed", error=f"jsonl path must stay inside the export folder {self.root}"
            )
        run_id = judged.run_id or judged.result.run_id
        try:
            async with self._lock:
                written = await asyncio.to_thread(self._append_once, run_id, self._line(judged, run_id))
        except OSError as e:
            return SinkOutcome(sink=self.name, status="failed", error=f"{type(e).__name__}: {e}")
        del written  # a redelivered case was already in the file: still exported, once
        return SinkOutcome(sink=self.name, status="ok", external_id=run_id, url=self.path.resolve().as_uri())

    async def close(self) -> None:
        return None

    @staticmethod
    def _line(judged: CaseJudged, run_id: str) -> bytes:
        scores = [s for s in judged.result.scores if isinstance(s, Measured)]
        failure = judged.result.failure
        line = JsonlLine(
            batch_id=judged.batch_id,
            case_id=judged.case_id,
            run_id=run_id,
            trial=judged.result.trial,
            status=judged.status,
            answer=judged.result.answer,
            scores={s.metric: s.value for s in scores},
            passed={s.metric: s.passed for s in scores if s.passed is not None},
            failure=None if failure is None else f"{failure.stage}/{failure.failure_class}/{failure.code}",
            exported_at=utcnow().isoformat(),
        )
        return _encoder.encode(line) + b"\n"

    def _append_once(self, run_id: str, line: bytes) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._scan(fd)
            if run_id in self._index.run_ids:
                return False
            os.write(fd, line)
            self._index.run_ids.add(run_id)
            self._index.offset += len(line)
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _scan(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        if size < self._index.offset:  # truncated or replaced: start over
            self._index = _Index()
        if size == self._index.offset:
            return
        os.lseek(fd, self._index.offset, os.SEEK_SET)
        tail = os.read(fd, size - self._index.offset)
        complete = tail[: tail.rfind(b"\n") + 1]
        for raw in complete.splitlines():
            try:
                doc = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                continue
            if isinstance(doc, dict) and isinstance(doc.get("run_id"), str):
                self._index.run_ids.add(doc["run_id"])
        self._index.offset += len(complete)
