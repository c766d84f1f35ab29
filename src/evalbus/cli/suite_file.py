"""A suite file (YAML, or JSON) as a `BatchSpec`, every problem named by its field path.

The file is a batch spec with three conveniences the CLI expands before it submits (the gateway
only ever receives a plain `BatchSpec`):

- `suite.dataset`: cases read from a JSONL, CSV, JSON or Parquet file (`evalbus.cli.dataset`),
  after the inline `cases`;
- `suite.graders`: graders every case gets, before its own;
- a case `input` that is a mapping or a list: handed to the harness as JSON text.

It is read strictly: a key the format does not know (`trails` for `trials`, `grader` for
`graders`) or a value outside its set is refused with the nearest known one, where the bus's own
decoding would ignore it.

Paths in the harness command are relative to the suite file: an element of `harness.command`
that names an existing file next to the suite (`agent.py`, `bin/agent`) becomes its absolute
path, so `python3 agent.py` works whatever the working directory (and so does a worker harness's
`python: agent.py:solve`). Relative `jsonl` sink paths are
left alone: the exporter resolves them inside its export folder. A dataset path is relative to the
suite file too.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from evalbus.cli.dataset import DatasetCase, DatasetError, DatasetSpec, input_text, load_dataset
from evalbus_api.validation import batch_spec_problems
from evalbus_contracts import BatchSpec, CaseSpec, GraderSpec, JudgeSpec, SuiteSpec, convert
from evalbus_contracts.strict import error_location, strict_problems

T = TypeVar("T")

_YAML_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader when PyYAML was built with it: ten times faster on a large suite."""


class FileSuite(SuiteSpec, frozen=True, kw_only=True):
    """`suite` as a suite file writes it: inline `cases` and/or a `dataset`, plus suite-wide
    `graders`."""

    cases: tuple[CaseSpec, ...] = ()
    """Inline cases (a case's `input` may be a mapping or a list: it is passed on as JSON text)."""
    dataset: DatasetSpec | None = None
    """Cases read from a file, after the inline ones."""
    graders: tuple[GraderSpec, ...] = ()
    """Graders every case gets, before its own (so their ids must not repeat a case's)."""


class SuiteFile(BatchSpec, frozen=True, kw_only=True):
    """A suite file: a batch spec whose suite may name a dataset and suite-wide graders."""

    suite: FileSuite
    """The dataset: inline cases, a dataset file, or both."""


class SpecFileError(Exception):
    """A suite (or judges) file or text that is not a valid spec: what is wrong, by field."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        super().__init__(f"{source}: " + "; ".join(f"{field}: {message}" for field, message in problems))
        self.source = source
        """The file (or `--judges` text) that is wrong."""
        self.problems = problems
        """`(field path, message)` pairs, in document order."""


def parse_document(text: str, source: str) -> Any:
    """YAML (JSON is YAML too) text as plain data; `SpecFileError` at `$` naming the line when it
    does not parse (found again by the pure-Python loader, whose marks are the more precise).
    JSON text is read by msgspec first: a YAML loader takes seconds on a suite of 10,000 cases."""
    if text.lstrip().startswith(("{", "[")):
        try:
            return msgspec.json.decode(text)
        except msgspec.DecodeError:
            pass  # YAML's flow style looks like JSON too
    try:
        return yaml.load(text, Loader=_YAML_LOADER)  # noqa: S506 - a safe loader (libyaml's when built in)
    except yaml.YAMLError:
        pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise SpecFileError(source, [("$", f"not valid YAML{where}: {problem}")]) from None


def convert_as(data: Any, kind: type[T], source: str, root: str = "$") -> T:
    """Validate plain data as `kind`, strictly; `SpecFileError` naming every unknown key (or value
    outside its set), else the first offending field (JSON paths under `root`, the same paths the
    gateway's 400 errors use)."""
    unknown = strict_problems(data, kind, root)
    if unknown:
        raise SpecFileError(source, [(p.field, p.message) for p in unknown])
    try:
        return convert(data, kind)
    except msgspec.ValidationError as e:
        raise SpecFileError(source, [error_location(e, root)]) from None


def resolve_command(spec: BatchSpec, folder: Path) -> BatchSpec:
    """`spec` with each relative `harness.command` element that names an existing file in
    `folder` replaced by its absolute path, and likewise the file of a worker's
    `harness.python: file.py:function`."""
    command = tuple(
        str((folder / arg).resolve()) if arg and not Path(arg).is_absolute() and (folder / arg).is_file() else arg
        for arg in spec.harness.command
    )
    python = spec.harness.python
    if python is not None:  # a worker's `file.py:function` next to the suite
        where, sep, name = python.rpartition(":")
        if sep and where.endswith(".py") and not Path(where).is_absolute() and (folder / where).is_file():
            python = f"{(folder / where).resolve()}:{name}"
    if command == spec.harness.command and python == spec.harness.python:
        return spec
    harness = msgspec.structs.replace(spec.harness, command=command, python=python)
    return msgspec.structs.replace(spec, harness=harness)


SCRIPT_SUFFIXES = (".py", ".sh", ".js", ".mjs", ".ts", ".rb", ".pl")
"""A command argument with one of these endings names a script the harness needs to exist."""


def harness_warnings(spec: BatchSpec, *, path: str | None = None) -> list[str]:
    """What about the harness looks missing on this machine, before anything is submitted: its
    program not on `path` (default: this process's PATH, the one a local stack's harness gets) or
    not a file, a script argument or a worker's `file.py` neither in `harness.files` nor next to the
    suite (`resolve_command` made those that exist absolute). Warnings, not errors: a cluster's
    case image may have what this machine lacks."""
    harness = spec.harness
    files = set(harness.files)
    out: list[str] = []
    if harness.command:
        program = harness.command[0]
        if program in files:
            pass
        elif "/" in program:
            if not Path(program).is_file():
                out.append(f"the harness program {program!r} does not exist")
        elif shutil.which(program, path=path) is None:
            out.append(f"the harness program {program!r} is not on PATH")
        for arg in harness.command[1:]:
            if (
                arg.endswith(SCRIPT_SUFFIXES)
                and arg not in files
                and not arg.startswith("-")
                and not Path(arg).is_file()
            ):
                out.append(f"the harness's {arg!r} is neither next to the suite file nor in harness.files")
    if harness.python is not None:
        where, sep, _ = harness.python.rpartition(":")
        if sep and where.endswith(".py") and where not in files and not Path(where).is_file():
            out.append(
                f"the worker's {where!r} (harness.python) is neither next to the suite file nor in harness.files"
            )
    return out


def load_suite(path: Path) -> BatchSpec:
    """Read, validate, expand and resolve a suite file; `SpecFileError` with every problem found."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SpecFileError(source, [("$", f"cannot read the file: {reason}")]) from None
    data = parse_document(text, source)
    if not isinstance(data, dict):
        raise SpecFileError(source, [("$", f"expected a mapping with suite, harness, judges…, got {_kind(data)}")])
    _inputs_as_text(data)
    folder = path.resolve().parent
    file = convert_as(data, SuiteFile, source)
    spec, origins, unread = expand(file, folder, source)
    shared = len(file.suite.graders)
    rules = [(locate(p.field, origins, shared), p.message) for p in batch_spec_problems(spec)]
    problems = with_dataset_problems(unread, rules)
    if problems:
        raise SpecFileError(source, problems)
    return resolve_command(spec, folder)


@dataclass(frozen=True, slots=True)
class CaseOrigin:
    """Where a case of the expanded spec was written, so a broken rule is reported there."""

    case_at: str
    """`$.suite.cases[3]` for an inline case, `cases.jsonl line 7` for a dataset row."""
    columns: dict[str, str] | None
    """Case field → dataset column (None: an inline case, whose fields are its own keys)."""
    graders_at: str
    """Where the case's own graders were written (they follow the suite's in the expanded case)."""

    def field(self, name: str) -> str:
        """Where field `name` of the case was written."""
        if self.columns is None:
            return f"{self.case_at}.{name}"
        return f"{self.case_at}, field {self.columns.get(name, name)}"


NO_CASES = "a batch needs at least one case"
"""The rule a dataset whose every row is unreadable would also break (its rows are the problem)."""


def with_dataset_problems(unread: list[tuple[str, str]], rules: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A dataset's own problems, then the rules its readable rows break (without "no case" when
    some rows could not be read: those rows are what is wrong)."""
    if unread:
        rules = [r for r in rules if not (r[0] == "$.suite.cases" and r[1] == NO_CASES)]
    return list(dict.fromkeys(unread + rules))


def expand(file: SuiteFile, folder: Path, source: str) -> tuple[BatchSpec, list[CaseOrigin], list[tuple[str, str]]]:
    """The batch spec a suite file means — its inline cases, then its dataset's, each with the
    suite's graders first — where each case was written, and the dataset's problems (its rows
    with problems are left out of the spec, so the others can be checked too)."""
    suite = file.suite
    cases = list(suite.cases)
    unread: list[tuple[str, str]] = []
    origins = [CaseOrigin(f"$.suite.cases[{i}]", None, f"$.suite.cases[{i}].graders") for i in range(len(cases))]
    if suite.dataset is not None:
        try:
            loaded: list[DatasetCase] = load_dataset(suite.dataset, folder)
        except DatasetError as e:
            unread, loaded = e.problems, e.readable
        cases.extend(d.case for d in loaded)
        origins.extend(CaseOrigin(d.where, d.columns, d.graders_at) for d in loaded)
    if suite.graders:
        cases = [msgspec.structs.replace(c, graders=suite.graders + c.graders) for c in cases]
    plain = {name: getattr(suite, name) for name in SuiteSpec.__struct_fields__}
    batch = {name: getattr(file, name) for name in BatchSpec.__struct_fields__}
    batch["suite"] = SuiteSpec(**{**plain, "cases": tuple(cases)})
    return BatchSpec(**batch), origins, unread


_CASE_FIELD = re.compile(r"^\$\.suite\.cases\[(?P<index>\d+)\]\.(?P<name>\w+)(?P<rest>.*)$")
_GRADER = re.compile(r"^\[(?P<index>\d+)\](?P<rest>.*)$")


def locate(field: str, origins: list[CaseOrigin], shared: int) -> str:
    """A rule's field in the expanded spec (`$.suite.cases[k]…`) as where it was written: an
    inline case, a dataset row and column, or one of the `shared` suite-wide graders."""
    match = _CASE_FIELD.match(field)
    if match is None or int(match["index"]) >= len(origins):
        return field
    origin, name, rest = origins[int(match["index"])], match["name"], match["rest"]
    grader = _GRADER.match(rest) if name == "graders" else None
    if grader is not None:
        j = int(grader["index"])
        if j < shared:
            return f"$.suite.graders[{j}]{grader['rest']}"
        return f"{origin.graders_at}[{j - shared}]{grader['rest']}"
    return origin.field(name) + rest


def _inputs_as_text(data: dict[str, Any]) -> None:
    """Inline case inputs that are mappings or lists, as the JSON text the harness receives."""
    suite = data.get("suite")
    cases = suite.get("cases") if isinstance(suite, dict) else None
    if not isinstance(cases, list):
        return
    for case in cases:
        if isinstance(case, dict) and isinstance(case.get("input"), (dict, list)):
            case["input"] = input_text(case["input"])


def load_judges(value: str) -> tuple[JudgeSpec, ...]:
    """`--judges`: a file, or inline JSON/YAML, holding a list of judges (or `{judges: [...]}`)."""
    candidate = Path(value)
    source = "--judges"
    text = value
    looks_like_a_path = candidate.suffix.lower() in (".yaml", ".yml", ".json") or "/" in value
    if (
        "\n" not in value
        and not value.lstrip().startswith(("[", "{"))
        and looks_like_a_path
        and not candidate.is_file()
    ):
        raise SpecFileError(value, [("$", "no such file")])
    if "\n" not in value and candidate.is_file():
        source = str(candidate)
        try:
            text = candidate.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SpecFileError(source, [("$", f"cannot read the file: {e}")]) from None
    data = parse_document(text, source)
    root = "$"
    if isinstance(data, dict) and "judges" in data:
        data, root = data["judges"], "$.judges"
    if not isinstance(data, list):
        raise SpecFileError(source, [(root, f"expected a list of judges, got {_kind(data)}")])
    return convert_as(data, tuple[JudgeSpec, ...], source, root)


def _kind(data: Any) -> str:
    return "nothing" if data is None else type(data).__name__
