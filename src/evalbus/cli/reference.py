"""The field tables of `docs/suites.md` and `docs/harness.md`, generated from the spec and trace
structs so the reference cannot drift from the code.

A doc marks each generated block with `<!-- fields: ClassName -->` … `<!-- /fields -->`; between
the marks goes the struct's docstring and one row per key: its name as written in a file, its type,
its default (or `required`) and its field docstring. Everything outside the marks is prose written
by hand. `evalbus schemas` rewrites the blocks; `evalbus schemas --check` and a test fail when a
block is stale, missing, or names a struct that does not exist.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import re
import textwrap
import typing
from collections.abc import Iterator
from pathlib import Path

import msgspec
import msgspec.inspect as mi

from evalbus.cli.suite_file import SuiteFile
from evalbus_contracts import GraderSpec, JudgeSpec, SinkSpec, TraceEvent
from evalbus_contracts.specs import COMPUTE_GRADER_KINDS
from evalbus_contracts.worker_protocol import CaseMessage, WorkerOutput

REFERENCE_DOCS: tuple[str, ...] = ("suites.md", "harness.md")
"""The docs (in the docs folder) holding generated field tables."""

_BLOCK = re.compile(r"(<!-- fields: (?P<name>\w+) -->\n)(?P<body>.*?)(<!-- /fields -->)", re.DOTALL)

_UNIONS: dict[frozenset[type], tuple[str, str]] = {
    frozenset(typing.get_args(GraderSpec)): ("grader", "graders"),
    frozenset(typing.get_args(JudgeSpec)): ("judge", "judges"),
    frozenset(typing.get_args(SinkSpec)): ("sink", "sinks"),
    frozenset(typing.get_args(TraceEvent)): ("trace event", "trace-events"),
}
"""Tagged unions by their members: how a type names them, and the anchor of their section."""


def documented_structs() -> dict[str, type[msgspec.Struct]]:
    """Class name → struct, for every struct a reference doc may (and must) describe: everything a
    suite file can hold, every trace event kind, and the worker protocol's messages."""
    found: dict[str, type[msgspec.Struct]] = {}
    for t in (mi.type_info(SuiteFile), mi.type_info(TraceEvent), mi.type_info(CaseMessage | WorkerOutput)):
        for struct in _reachable(t):
            found.setdefault(struct.cls.__name__, struct.cls)
    return found


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Python field name → its docstring (the string literal under it), own or inherited."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, msgspec.Struct)) or klass is msgspec.Struct:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def struct_block(cls: type[msgspec.Struct]) -> str:
    """The generated block of one struct: an anchor, its docstring, its table."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    docs = field_docs(cls)
    lead = _one_line(inspect.getdoc(cls) or "")
    if info.tag_field is not None and info.tag is not None:
        lead = f"`{info.tag_field}: {info.tag}` — {lead}"
        if issubclass(cls, typing.get_args(GraderSpec)):
            lead += (
                " Runs in the sandbox, before it is released."
                if info.tag in COMPUTE_GRADER_KINDS
                else " Reads the trace and the answer, after the sandbox is released."
            )
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    if info.tag_field is not None and info.tag is not None:
        rows.append(f"| `{info.tag_field}` | `{info.tag}` | required | Selects this kind. |")
    for f in info.fields:
        meaning = _cell(_one_line(docs.get(f.name, "")))
        rows.append(
            f"| `{f.encode_name}` | {_cell(describe_type(f.type))} | {_cell(describe_default(f))} | {meaning} |"
        )
    return f'<a id="{anchor(cls)}"></a>{lead}\n\n' + "\n".join(rows) + "\n\n"


def undocumented(cls: type[msgspec.Struct]) -> list[str]:
    """Fields of `cls` without a docstring, and the class itself when it has none."""
    docs = field_docs(cls)
    missing = [f for f in cls.__struct_fields__ if not docs.get(f)]
    return ([cls.__name__] if not inspect.getdoc(cls) else []) + [f"{cls.__name__}.{f}" for f in missing]


def render_doc(text: str, structs: dict[str, type[msgspec.Struct]] | None = None) -> str:
    """`text` with every marked block regenerated; `KeyError` naming an unknown struct."""
    known = documented_structs() if structs is None else structs

    def block(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in known:
            raise KeyError(f"<!-- fields: {name} --> names no documented struct")
        return match.group(1) + struct_block(known[name]) + match.group(4)

    return _BLOCK.sub(block, text)


def blocks_in(text: str) -> list[str]:
    """The struct names of the marked blocks, in order."""
    return [m["name"] for m in _BLOCK.finditer(text)]


def reference_drift(docs: Path) -> list[str]:
    """What is out of date in the reference docs under `docs` (empty: in sync)."""
    problems: list[str] = []
    for name in REFERENCE_DOCS:
        path = docs / name
        if not path.is_file():
            problems.append(f"missing {path}")
            continue
        text = path.read_text(encoding="utf-8")
        try:
            if render_doc(text) != text:
                problems.append(f"changed {path} (its field tables)")
        except KeyError as e:
            problems.append(f"{path}: {e.args[0]}")
    return problems


def write_reference(docs: Path) -> list[str]:
    """Regenerate the field tables of the reference docs under `docs`; the paths rewritten."""
    written: list[str] = []
    for name in REFERENCE_DOCS:
        path = docs / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        rendered = render_doc(text)
        if rendered != text:
            path.write_text(rendered, encoding="utf-8")
            written.append(str(path))
    return written


# ---------------------------------------------------------------- types and defaults


def anchor(cls: type) -> str:
    """The anchor of a struct's block."""
    return cls.__name__.lower()


def describe_type(t: mi.Type) -> str:
    """A type as the reference writes it (`list of [grader](#graders)`, `integer ≥ 1 or null`)."""
    if isinstance(t, mi.Metadata):
        return describe_type(t.type)
    if isinstance(t, mi.StrType):
        return "string"
    if isinstance(t, mi.BoolType):
        return "boolean"
    if isinstance(t, mi.IntType | mi.FloatType):
        return ("integer" if isinstance(t, mi.IntType) else "number") + _bounds(t)
    if isinstance(t, mi.NoneType):
        return "null"
    if isinstance(t, mi.AnyType):
        return "any JSON value"
    if isinstance(t, mi.RawType):
        return "JSON object"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(f"`{v}`" for v in t.values)
    if isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
        return "list of " + describe_type(t.item_type)
    if isinstance(t, mi.DictType):
        return f"mapping of {describe_type(t.key_type)} to {describe_type(t.value_type)}"
    if isinstance(t, mi.StructType):
        return f"[{t.cls.__name__}](#{anchor(t.cls)})"
    if isinstance(t, mi.UnionType):
        return _describe_union(t)
    return type(t).__name__


def describe_default(f: mi.Field) -> str:
    """`required`, or the default as JSON."""
    if f.required:
        return "required"
    value = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
    return f"`{msgspec.json.encode(msgspec.to_builtins(value)).decode()}`"


def _describe_union(t: mi.UnionType) -> str:
    members = list(t.types)
    nullable = any(isinstance(m, mi.NoneType) for m in members)
    members = [m for m in members if not isinstance(m, mi.NoneType)]
    structs = frozenset(m.cls for m in members if isinstance(m, mi.StructType))
    named = _UNIONS.get(structs) if len(structs) == len(members) and len(structs) > 1 else None
    text = f"[{named[0]}](#{named[1]})" if named else " or ".join(describe_type(m) for m in members)
    return text + (" or null" if nullable else "")


def _bounds(t: mi.IntType | mi.FloatType) -> str:
    parts = [
        f"{sign} {value}" for sign, value in (("≥", t.ge), (">", t.gt), ("≤", t.le), ("<", t.lt)) if value is not None
    ]
    return (" " + " and ".join(parts)) if parts else ""


def _reachable(t: mi.Type, seen: set[type] | None = None) -> Iterator[mi.StructType]:
    seen = set() if seen is None else seen
    if isinstance(t, mi.Metadata):
        yield from _reachable(t.type, seen)
    elif isinstance(t, mi.StructType):
        if t.cls in seen:
            return
        seen.add(t.cls)
        yield t
        for f in t.fields:
            yield from _reachable(f.type, seen)
    elif isinstance(t, mi.UnionType):
        for m in t.types:
            yield from _reachable(m, seen)
    elif isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
        yield from _reachable(t.item_type, seen)
    elif isinstance(t, mi.DictType):
        yield from _reachable(t.value_type, seen)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
