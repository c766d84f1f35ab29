"""A suite's cases from a dataset file: JSONL, CSV, a JSON array, or Parquet (when pyarrow is
importable), one case per row, through a field mapping with defaults, then sampled, shuffled and
limited with a seed.

The CLI expands a dataset into inline cases before it submits, so the gateway and the pipeline
only ever see a `BatchSpec`. Every problem names the file, the line (JSONL, CSV), the element
(JSON) or the row (Parquet), and the field; all of them are collected before anything is refused.
"""

from __future__ import annotations

import csv
import io
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from evalbus_contracts import CaseSpec, GraderSpec, convert
from evalbus_contracts.strict import error_location, nearest, strict_problems

DatasetFormat = Literal["jsonl", "csv", "json", "parquet"]
"""How a dataset file is laid out."""

FORMAT_BY_SUFFIX: dict[str, DatasetFormat] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
}
"""The format a file name implies when `format` is not given."""

Count = Annotated[int, msgspec.Meta(ge=1)]
T = TypeVar("T")


class DatasetFields(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Which column (key, for JSON rows) holds each case field; each defaults to the field's own
    name. A column named here but present in no row is refused (a misspelt column would otherwise
    leave every case without it)."""

    id: str = "id"
    """Case id (a string or an integer). A row without it gets `row-<n>`, its 1-based position in
    the file, unless the column was named here explicitly."""
    input: str = "input"
    """The task: a string, or a JSON object or array handed to the harness as JSON text. Required."""
    expected: str = "expected"
    """The expected answer; a number or boolean is taken as its JSON text (`391`, `true`)."""
    tags: str = "tags"
    """A list of strings; in CSV (or any string value) comma-separated, or a JSON array."""
    metadata: str | tuple[str, ...] = "metadata"
    """One column holding an object of key/values (JSON text in CSV), or a list of columns copied
    into the metadata under their own names. Values that are not strings become their JSON text."""
    graders: str = "graders"
    """The case's own graders: a list of grader specs (JSON text in CSV), after the suite's."""
    timeout_s: str = "timeout_s"
    """Per-case harness timeout in seconds."""


class CaseDefaults(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Values for the fields a row leaves out (or leaves empty)."""

    expected: str | None = None
    """Expected answer."""
    tags: tuple[str, ...] = ()
    """Tags."""
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    """Metadata; a row's own keys are added over these."""
    graders: tuple[GraderSpec, ...] = ()
    """Graders of a row that names none."""
    timeout_s: float | None = None
    """Harness timeout."""


class DatasetSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Cases read from a file, one per row. The rows are read and checked in full; then `sample`
    draws, `shuffle` reorders, `limit` cuts, in that order, all from one seeded generator."""

    path: str
    """The file, relative to the suite file's folder (or absolute)."""
    format: DatasetFormat | None = None
    """`jsonl`, `csv` (a header row, UTF-8), `json` (an array of objects) or `parquet`; unset:
    from the file name's suffix (`.jsonl`/`.ndjson`, `.csv`, `.json`, `.parquet`/`.pq`)."""
    fields: DatasetFields = msgspec.field(default_factory=DatasetFields)
    """Which column holds each case field."""
    defaults: CaseDefaults = msgspec.field(default_factory=CaseDefaults)
    """Values for the fields a row leaves out."""
    sample: Count | None = None
    """Take this many rows drawn at random (seeded), kept in file order: a quick run."""
    shuffle: bool = False
    """Run the cases in a random (seeded) order instead of file order."""
    seed: int = 0
    """Seed of `sample` and `shuffle`: the same seed picks the same cases in the same order."""
    limit: Count | None = None
    """Take only the first this many cases (after `sample` and `shuffle`)."""


@dataclass(frozen=True, slots=True)
class Row:
    """One record of a dataset file."""

    where: str
    """`cases.jsonl line 3`, `cases.json [2]`, `cases.parquet row 3`."""
    number: int
    """1-based position among the file's records."""
    values: dict[str, Any]
    """Column → value."""
    text_cells: bool = False
    """Values are CSV text: lists and objects are given as JSON text, empty means absent."""


@dataclass(frozen=True, slots=True)
class DatasetCase:
    """A case read from a row, with where each of its fields came from."""

    case: CaseSpec
    """The case (its graders are the row's own, or the defaults')."""
    where: str
    """The row."""
    columns: dict[str, str]
    """Case field → the column it came from."""
    graders_at: str
    """Where the case's own graders came from (a column of the row, or the defaults)."""


class DatasetError(Exception):
    """A dataset that cannot be read into cases: every problem found, by location."""

    def __init__(self, problems: list[tuple[str, str]], readable: list[DatasetCase] | None = None) -> None:
        super().__init__("; ".join(f"{at}: {message}" for at, message in problems))
        self.problems = problems
        """`(location, message)` pairs, in file order."""
        self.readable = readable or []
        """The cases of the rows that had no problem (before any selection), so the suite's rules
        can be checked on them too and every problem reported at once."""


def load_dataset(spec: DatasetSpec, folder: Path, at: str = "$.suite.dataset") -> list[DatasetCase]:
    """The cases of `spec` (a path relative to `folder`), selected as it says; `DatasetError`
    with every problem (`at` is where the spec sits in the suite file)."""
    path = (folder / Path(spec.path).expanduser()).resolve()
    fmt = spec.format or FORMAT_BY_SUFFIX.get(path.suffix.lower())
    if fmt is None:
        choices = ", ".join(sorted(set(FORMAT_BY_SUFFIX.values())))
        raise DatasetError(
            [(f"{at}.format", f"cannot tell the format of {spec.path!r} from its name: set one of {choices}")]
        )
    if not path.is_file():
        raise DatasetError([(f"{at}.path", f"no such file: {path}")])
    rows, problems = _read_rows(path, fmt, spec.path, at)
    cases: list[DatasetCase] = []
    try:  # the rows that could be read are checked too: every problem of the file at once
        cases = _cases(rows, spec, at, every_row=not problems) if rows or not problems else []
    except DatasetError as e:
        problems, cases = problems + e.problems, e.readable
    if problems:
        raise DatasetError(sorted(problems, key=_line_order), cases)
    return select(cases, spec)


def _line_order(problem: tuple[str, str]) -> int:
    """Problems of a file in the order of its lines (`… line 12…`, `… [3]…`, `… row 4…`); those of
    the spec itself first, in their own order (the sort is stable)."""
    found = re.findall(r"(?: line | \[| row )(\d+)", problem[0])  # the last: the name may hold one too
    return int(found[-1]) if found else -1


def select(cases: list[T], spec: DatasetSpec) -> list[T]:
    """`sample`, then `shuffle`, then `limit`, drawn from one generator seeded with `seed`."""
    rng = random.Random(spec.seed)
    chosen = list(cases)
    if spec.sample is not None and spec.sample < len(chosen):
        picked = sorted(rng.sample(range(len(chosen)), spec.sample))
        chosen = [chosen[i] for i in picked]
    if spec.shuffle:
        rng.shuffle(chosen)
    if spec.limit is not None:
        chosen = chosen[: spec.limit]
    return chosen


# ---------------------------------------------------------------- reading rows


_Read = tuple[list[Row], list[tuple[str, str]]]
"""The rows that could be read, and the problems of those that could not."""


def _read_rows(path: Path, fmt: DatasetFormat, name: str, at: str) -> _Read:
    if fmt == "parquet":
        return _parquet_rows(path, name, at), []
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DatasetError([(f"{at}.path", f"cannot read {path}: {e.strerror or e}")]) from None
    if fmt == "jsonl":
        return _jsonl_rows(raw, name)
    if fmt == "json":
        return _json_rows(raw, name)
    return _csv_rows(raw, name)


def _jsonl_rows(raw: bytes, name: str) -> _Read:
    problems: list[tuple[str, str]] = []
    rows: list[Row] = []
    decoder = msgspec.json.Decoder()
    number = 0
    for line_no, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        number += 1
        where = f"{name} line {line_no}"
        try:
            value = decoder.decode(line)
        except msgspec.DecodeError as e:
            problems.append((where, f"not valid JSON: {e}"))
            continue
        if not isinstance(value, dict):
            problems.append((where, f"expected a JSON object, got {_kind(value)}"))
            continue
        rows.append(Row(where, number, value))
    return rows, problems


def _json_rows(raw: bytes, name: str) -> _Read:
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        try:
            json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
            raise DatasetError([(name, f"not valid JSON{where}: {e}")]) from None
        raise DatasetError([(name, "not valid JSON")]) from None
    if not isinstance(doc, list):
        raise DatasetError([(name, f"expected a JSON array of objects, got {_kind(doc)}")])
    problems = [
        (f"{name} [{i}]", f"expected a JSON object, got {_kind(v)}")
        for i, v in enumerate(doc)
        if not isinstance(v, dict)
    ]
    return [Row(f"{name} [{i}]", i + 1, value) for i, value in enumerate(doc) if isinstance(value, dict)], problems


def _csv_rows(raw: bytes, name: str) -> _Read:
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DatasetError([(name, f"not UTF-8 text: {e}")]) from None
    # The csv module splits lines itself; strict: a quote never closed is an error, not a cell
    # running to the end of the file.
    reader = csv.DictReader(io.StringIO(text, newline=""), strict=True)
    if not reader.fieldnames:
        raise DatasetError([(name, "no header row: the first line names the columns")])
    rows: list[Row] = []
    problems: list[tuple[str, str]] = []
    start = reader.line_num + 1
    try:
        for number, record in enumerate(reader, 1):
            where = f"{name} line {start}"
            start = reader.line_num + 1
            if None in record:
                problems.append((where, f"more values than the {len(reader.fieldnames)} header columns"))
                continue
            values = {k: v for k, v in record.items() if v is not None and v != ""}
            rows.append(Row(where, number, values, text_cells=True))
    except csv.Error as e:
        if "unexpected end of data" in str(e):
            problems.append((f"{name} line {start}", "a quoted cell that starts on this line is never closed"))
        else:
            problems.append((f"{name} line {reader.line_num}", f"not valid CSV: {e}"))
    return rows, problems


def _parquet_rows(path: Path, name: str, at: str) -> list[Row]:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise DatasetError(
            [(f"{at}.format", "Parquet needs pyarrow, which is not installed here (pip install pyarrow)")]
        ) from None
    try:
        records: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises its own error types for a file that is not Parquet
        raise DatasetError([(name, f"not a readable Parquet file: {e}")]) from None
    return [Row(f"{name} row {i}", i, {k: v for k, v in r.items() if v is not None}) for i, r in enumerate(records, 1)]


# ---------------------------------------------------------------- rows to cases


class _BadValue(Exception):
    def __init__(self, column: str, message: str) -> None:
        super().__init__(message)
        self.column = column
        self.message = message


def _cases(rows: list[Row], spec: DatasetSpec, at: str, *, every_row: bool = True) -> list[DatasetCase]:
    """The rows as cases; `every_row` False when some rows could not be read (then a column seen
    in no readable row may be in an unreadable one: not said)."""
    if not rows:
        raise DatasetError([(f"{at}.path", f"{spec.path} holds no rows")])
    unmapped = _unseen_columns(rows, spec.fields, at) if every_row else []
    if unmapped:
        raise DatasetError(unmapped)
    problems: list[tuple[str, str]] = []
    cases: list[DatasetCase] = []
    first_at: dict[str, str] = {}
    for row in rows:
        try:
            case_id = _row_id(row, spec.fields)
            earlier = first_at.setdefault(case_id, row.where)
            if earlier != row.where:
                raise _BadValue(spec.fields.id, f"duplicate case id {case_id!r} (first at {earlier})")
            cases.append(_case(row, spec, at, case_id))
        except _BadValue as e:
            problems.append((f"{row.where}, field {e.column}", e.message))
        except DatasetError as e:
            problems.extend(e.problems)
    if problems:
        raise DatasetError(problems, cases)
    return cases


def _unseen_columns(rows: list[Row], fields: DatasetFields, at: str) -> list[tuple[str, str]]:
    """A problem for each column named explicitly in `fields` that no row has (a misspelt column
    would otherwise quietly leave every case without that field)."""
    seen: set[str] = set()
    for row in rows:
        seen.update(row.values)
    defaults = DatasetFields()
    problems: list[tuple[str, str]] = []
    for name in DatasetFields.__struct_fields__:
        named = getattr(fields, name)
        if named == getattr(defaults, name) and name != "input":
            continue
        for column in (named,) if isinstance(named, str) else named:
            if column in seen:
                continue
            hint = nearest(column, seen)
            more = f"; did you mean {hint!r}?" if hint else f" (columns: {', '.join(sorted(seen)) or 'none'})"
            problems.append((f"{at}.fields.{name}", f"column {column!r} is in no row (or empty in all){more}"))
    return problems


def _row_id(row: Row, fields: DatasetFields) -> str:
    """The case id of a row: its id column, else (when that column was not named explicitly)
    `row-<n>`."""
    if fields.id in row.values:
        return _id(row.values[fields.id], fields.id)
    if fields.id == "id":
        return f"row-{row.number}"
    raise _BadValue(fields.id, "missing (it holds the case id)")


def _case(row: Row, spec: DatasetSpec, at: str, case_id: str) -> DatasetCase:
    fields, defaults, values = spec.fields, spec.defaults, row.values
    columns = {"id": fields.id, "input": fields.input}
    if fields.input not in values:
        raise _BadValue(fields.input, "missing (it holds the case input)")
    text = _input(values[fields.input], fields.input, text_cells=row.text_cells)
    expected = defaults.expected
    if fields.expected in values:
        columns["expected"] = fields.expected
        expected = _text(values[fields.expected])
    tags = defaults.tags
    if fields.tags in values:
        columns["tags"] = fields.tags
        tags = _tags(values[fields.tags], fields.tags)
    metadata = dict(defaults.metadata)
    if isinstance(fields.metadata, str):
        if fields.metadata in values:
            columns["metadata"] = fields.metadata
            metadata.update(_metadata(values[fields.metadata], fields.metadata))
    else:
        metadata.update({c: _text(values[c]) for c in fields.metadata if c in values})
    graders = defaults.graders
    graders_at = f"{at}.defaults.graders"
    if fields.graders in values:
        columns["graders"] = fields.graders
        graders_at = f"{row.where}, field {fields.graders}"
        graders = _graders(values[fields.graders], fields.graders, row)
    timeout_s = defaults.timeout_s
    if fields.timeout_s in values:
        columns["timeout_s"] = fields.timeout_s
        timeout_s = _seconds(values[fields.timeout_s], fields.timeout_s)
    case = CaseSpec(
        id=case_id, input=text, expected=expected, graders=graders, tags=tags, timeout_s=timeout_s, metadata=metadata
    )
    return DatasetCase(case, row.where, columns, graders_at)


def input_text(value: Any) -> str | None:
    """A case input as the harness receives it: a string as it is, an object or array as compact
    JSON text; None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return None


def _id(value: Any, column: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _BadValue(column, f"a case id must be a string or an integer, got {_kind(value)}")
    return str(value)


def _input(value: Any, column: str, *, text_cells: bool) -> str:
    text = value if text_cells else input_text(value)
    if not isinstance(text, str):
        raise _BadValue(column, f"an input must be a string or a JSON object, got {_kind(value)}")
    return text


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _json_cell(value: Any, column: str, what: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise _BadValue(column, f"expected {what} as JSON text: {e}") from None


def _tags(value: Any, column: str) -> tuple[str, ...]:
    if isinstance(value, str) and not value.lstrip().startswith("["):
        return tuple(t.strip() for t in value.split(",") if t.strip())
    value = _json_cell(value, column, "a list of tags")
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise _BadValue(column, "tags must be a list of strings (or comma-separated text)")
    return tuple(value)


def _metadata(value: Any, column: str) -> dict[str, str]:
    value = _json_cell(value, column, "an object")
    if not isinstance(value, dict):
        raise _BadValue(column, f"metadata must be an object of key/values, got {_kind(value)}")
    return {str(k): _text(v) for k, v in value.items()}


def _graders(value: Any, column: str, row: Row) -> tuple[GraderSpec, ...]:
    value = _json_cell(value, column, "a list of graders")
    at = f"{row.where}, field {column}"
    problems = strict_problems(value, tuple[GraderSpec, ...], root="")
    if problems:
        raise DatasetError([(at + p.field, p.message) for p in problems])
    try:
        return convert(value, tuple[GraderSpec, ...])
    except msgspec.ValidationError as e:
        path, message = error_location(e, root="")
        raise DatasetError([(at + path, message)]) from None


def _seconds(value: Any, column: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise _BadValue(column, f"expected a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _BadValue(column, f"expected a number of seconds, got {_kind(value)}")
    return float(value)


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__
