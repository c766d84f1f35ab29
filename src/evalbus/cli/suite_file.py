"""A suite file (YAML, or JSON) as a `BatchSpec`, every problem named by its field path.

Paths in the harness command are relative to the suite file: an element of `harness.command`
that names an existing file next to the suite (`agent.py`, `bin/agent`) becomes its absolute
path, so `python3 agent.py` works whatever the working directory. Relative `jsonl` sink paths are
left alone: the exporter resolves them inside its export folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from evalbus_contracts import BatchSpec, JudgeSpec, convert
from evalbus_gateway.api.errors import field_of
from evalbus_gateway.api.validation import batch_spec_problems

T = TypeVar("T")


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
    does not parse."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise SpecFileError(source, [("$", f"not valid YAML{where}: {problem}")]) from None


def convert_as(data: Any, kind: type[T], source: str, root: str = "$") -> T:
    """Validate plain data as `kind`; `SpecFileError` naming the offending field (its JSON path
    under `root`, the same path the gateway's 400 errors use)."""
    try:
        return convert(data, kind)
    except msgspec.ValidationError as e:
        field, message = field_of(e, root)
        raise SpecFileError(source, [(field, message)]) from None


def resolve_command(spec: BatchSpec, folder: Path) -> BatchSpec:
    """`spec` with each relative `harness.command` element that names an existing file in
    `folder` replaced by its absolute path."""
    command = tuple(
        str((folder / arg).resolve()) if arg and not Path(arg).is_absolute() and (folder / arg).is_file() else arg
        for arg in spec.harness.command
    )
    if command == spec.harness.command:
        return spec
    return msgspec.structs.replace(spec, harness=msgspec.structs.replace(spec.harness, command=command))


def load_suite(path: Path) -> BatchSpec:
    """Read, validate and resolve a suite file; `SpecFileError` with every problem found."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SpecFileError(source, [("$", f"cannot read the file: {reason}")]) from None
    data = parse_document(text, source)
    if not isinstance(data, dict):
        raise SpecFileError(source, [("$", f"expected a mapping with suite, harness, judges…, got {_kind(data)}")])
    spec = convert_as(data, BatchSpec, source)
    problems = [(p.field, p.message) for p in batch_spec_problems(spec)]
    if problems:
        raise SpecFileError(source, problems)
    return resolve_command(spec, path.resolve().parent)


def load_judges(value: str) -> tuple[JudgeSpec, ...]:
    """`--judges`: a file, or inline JSON/YAML, holding a list of judges (or `{judges: [...]}`)."""
    candidate = Path(value)
    source = "--judges"
    text = value
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
