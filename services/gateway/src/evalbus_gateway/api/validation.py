"""Input validation: bodies (size, JSON, shape), the batch spec's own rules, query and path
parameters, and the opaque page cursors. Every failure is an `ApiError` naming the field.

Bodies are read strictly: a key the body's type does not know (`trails` for `trials`) or a value
outside a fixed set is a 400 naming its path and the nearest known key, although the same types
decode leniently on the bus (events must stay readable by older replicas).

`check_batch_spec` turns the batch spec's own rules into a 400: the problems are found, as data, by
`evalbus_api.validation.batch_spec_problems` (the rules msgspec's types cannot express: unique ids,
ranges, regexes that compile, judge ids without `:`, gates that parse), each at the JSON path of
the offending value, so the CLI checks a suite file the same way before it sends it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from decimal import Decimal
from typing import TypeVar

import msgspec
from aiohttp import web

from evalbus_api.validation import (
    CONTROL_CHARS,
    MAX_ID_LENGTH,
    SpecProblem,
    batch_spec_problems,
    case_problems,
)
from evalbus_contracts import (
    BatchSpec,
    CaseSpec,
    DatasetIndex,
    decode,
)
from evalbus_contracts.strict import StrictProblem, strict_problems
from evalbus_gateway.api.errors import ApiError, invalid
from evalbus_grading.verdict import objective_metrics_of

T = TypeVar("T")

MAX_SEQ = 2**63 - 1
"""Largest stream sequence a `Last-Event-ID` may name (JetStream sequences are 64-bit)."""
_READ_CHUNK = 64 * 1024
_NESTED_TOO_DEEPLY = "request body is nested too deeply"


# ---------------------------------------------------------------- bodies


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes (413 beyond, also for chunked bodies)."""
    length = request.content_length
    if length is not None and length > limit:
        raise ApiError(413, "payload_too_large", f"request body of {length} bytes exceeds {limit} bytes", "$")
    buf = bytearray()
    while True:
        chunk = await request.content.read(_READ_CHUNK)
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise ApiError(413, "payload_too_large", f"request body exceeds {limit} bytes", "$")
    return bytes(buf)


def parse_json(body: bytes, kind: type[T]) -> T:
    """Decode `body` as `kind`: 400 `invalid_json` when it is not JSON, `invalid` when it is the
    wrong shape or holds a key `kind` does not know (the field is the JSON path of the bad value or
    key). Unknown keys are reported before type errors: a misspelt key usually explains a missing
    field."""
    if not body.strip():
        raise ApiError(400, "invalid_json", "request body is empty; expected a JSON object", "$")
    try:
        value = decode(body, kind)
    except msgspec.ValidationError as e:
        _raise_strict(body, kind)
        raise invalid(e) from None
    except msgspec.DecodeError as e:
        raise _not_json(e) from None
    except RecursionError:
        raise ApiError(400, "invalid_json", _NESTED_TOO_DEEPLY, "$") from None
    _raise_strict(body, kind)
    return value


def _not_json(error: msgspec.DecodeError) -> ApiError:
    return ApiError(400, "invalid_json", f"request body is not valid JSON: {error}", "$")


def strict_error(problems: Sequence[StrictProblem]) -> ApiError:
    """A 400 naming the first unknown key (or value outside its set) and how many more there are."""
    first = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return ApiError(400, "invalid", first.message + more, first.field)


_plain = msgspec.json.Decoder(float_hook=Decimal)
"""The strict walk's reader: any JSON number fits (a float beyond 1.8e308 is a `Decimal`), so
only the typed decode judges numbers, naming their field."""


def _raise_strict(body: bytes, kind: type[T]) -> None:
    # The typed decode may have skipped (unknown fields) or stopped before what the plain decode
    # reads in full, so the plain decode can still refuse the document.
    try:
        problems = strict_problems(_plain.decode(body), kind)
    except msgspec.DecodeError as e:  # e.g. a broken escape inside a skipped unknown field
        raise _not_json(e) from None
    except RecursionError:
        raise ApiError(400, "invalid_json", _NESTED_TOO_DEEPLY, "$") from None
    if problems:
        raise strict_error(problems)


async def read_json(request: web.Request, kind: type[T], limit: int) -> T:
    """Read and decode a JSON body."""
    return parse_json(await read_body(request, limit), kind)


# ---------------------------------------------------------------- the batch spec


MAX_DATASET_PROBLEMS = 20
"""Problems of an uploaded dataset listed in its 400 (then how many more there are)."""
MAX_OBJECTIVE_METRICS = 256
"""Distinct objective metric names a dataset may use (they ride in every `batch.requested`)."""


class DatasetChecker:
    """Reads an uploaded dataset — JSONL, one `CaseSpec` per line, blank lines skipped — as it
    arrives, however the chunks cut its lines, and checks every case strictly (unknown keys with the
    nearest known one, then the case rules of inline cases), naming each problem by its line. Pure:
    bytes in, problems and the dataset's `DatasetIndex` out."""

    def __init__(self) -> None:
        self.problems: list[SpecProblem] = []
        self.total_problems = 0
        self.lines = 0
        self._seen: set[str] = set()
        self._objective: set[str] = set()
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        """Check the lines `chunk` completes."""
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        for line in lines:
            self._row(line)

    def _problem(self, field: str, message: str) -> None:
        self.total_problems += 1
        if len(self.problems) < MAX_DATASET_PROBLEMS:
            at = f"line {self.lines}" + ("" if field == "$" else f", {field}")
            self.problems.append(SpecProblem(at, f"{at}: {message}"))

    def _row(self, line: bytes) -> None:
        self.lines += 1
        if not line.strip():
            return
        try:
            raw = _plain.decode(line)
        except msgspec.DecodeError as e:
            self._problem("$", f"not valid JSON: {e}")
            return
        except RecursionError:
            self._problem("$", "nested too deeply")
            return
        unknown = strict_problems(raw, CaseSpec)
        for problem in unknown:
            self._problem(problem.field, problem.message)
        if unknown:
            return
        try:
            case = decode(line, CaseSpec)
        except msgspec.ValidationError as e:
            message, _, where = str(e).partition(" - at `")
            self._problem(where.rstrip("`") or "$", message)
            return
        for rule in case_problems(case, "$", self._seen):
            self._problem(rule.field, rule.message)
        self._objective.update(objective_metrics_of(case.graders))

    def finish(self) -> DatasetIndex:
        """The dataset's index once every line is in; a 400 naming the first problem (its line and
        field) and how many more there are, when there is any."""
        if self._tail:
            self._row(self._tail)
            self._tail = b""
        if not self._seen and not self.total_problems:
            self.problems.append(SpecProblem("$", "a dataset needs at least one case (one JSON object per line)"))
            self.total_problems = 1
        if len(self._objective) > MAX_OBJECTIVE_METRICS:
            self._problem("$", f"more than {MAX_OBJECTIVE_METRICS} distinct objective metric names in the dataset")
        if self.problems:
            first = self.problems[0]
            more = f" (and {self.total_problems - 1} more)" if self.total_problems > 1 else ""
            raise ApiError(400, "invalid", first.message + more, first.field)
        return DatasetIndex(cases=len(self._seen), objective_metrics=tuple(sorted(self._objective)))


def check_batch_spec(spec: BatchSpec) -> None:
    """400 naming the first rule `spec` breaks."""
    problems = batch_spec_problems(spec)
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ApiError(400, "invalid", first.message + more, first.field)


# ---------------------------------------------------------------- parameters


def path_id(request: web.Request, name: str) -> str:
    """A path parameter holding an id (non-empty, bounded, no control characters)."""
    value = request.match_info.get(name, "")
    if not value.strip() or len(value) > MAX_ID_LENGTH:
        raise ApiError(400, "invalid", f"{name} must be 1 to {MAX_ID_LENGTH} characters", name)
    if CONTROL_CHARS.search(value):
        raise ApiError(400, "invalid", f"{name} must not contain control characters", name)
    return value


def _single(request: web.Request, name: str) -> str | None:
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise ApiError(400, "invalid", f"query parameter {name} is given more than once", name)
    if values and CONTROL_CHARS.search(values[0]):
        raise ApiError(400, "invalid", f"query parameter {name} must not contain control characters", name)
    return values[0] if values else None


def query_int(request: web.Request, name: str, *, default: int, low: int, high: int) -> int:
    """An integer query parameter within [low, high]."""
    raw = _single(request, name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ApiError(400, "invalid", f"{name} must be an integer, got {raw[:40]!r}", name) from None
    if not low <= value <= high:
        raise ApiError(400, "invalid", f"{name} must be between {low} and {high}", name)
    return value


def query_choice(request: web.Request, name: str, choices: Sequence[str]) -> str | None:
    """An optional query parameter from a fixed set."""
    raw = _single(request, name)
    if raw is None:
        return None
    if raw not in choices:
        raise ApiError(400, "invalid", f"{name} must be one of {', '.join(choices)}", name)
    return raw


def query_str(request: web.Request, name: str) -> str | None:
    """An optional query parameter."""
    return _single(request, name)


def header_seq(request: web.Request, name: str) -> int | None:
    """A header holding a stream sequence (e.g. `Last-Event-ID`)."""
    raw = request.headers.get(name)
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    if text.startswith("-") and text[1:].isascii() and text[1:].isdigit():
        raise ApiError(400, "invalid", f"{name} must not be negative", name)
    if not (text.isascii() and text.isdigit()):  # int() would also take "٣", "1_0" and " +1"
        raise ApiError(400, "invalid", f"{name} must be a stream sequence (an integer)", name)
    value = int(text)
    if value > MAX_SEQ:
        raise ApiError(400, "invalid", f"{name} must be at most {MAX_SEQ}", name)
    return value


# ---------------------------------------------------------------- cursors


class _Cursor(msgspec.Struct, frozen=True, array_like=True):
    kind: str
    scope: str
    key: tuple[str, ...]


def encode_cursor(kind: str, scope: str, key: Sequence[str]) -> str:
    """An opaque cursor: which list (`kind`, `scope`) and where it stopped (`key`)."""
    raw = msgspec.json.encode(_Cursor(kind, scope, tuple(key)))
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(value: str, kind: str, scope: str, *, size: int) -> tuple[str, ...]:
    """The key of a cursor made by `encode_cursor` for the same list; 400 `cursor` otherwise."""
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        cursor = msgspec.json.decode(raw, type=_Cursor)
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise ApiError(400, "invalid_cursor", "cursor is not one this API returned", "cursor") from None
    if cursor.kind != kind or cursor.scope != scope or len(cursor.key) != size:
        raise ApiError(400, "invalid_cursor", "cursor belongs to another list", "cursor")
    return cursor.key
