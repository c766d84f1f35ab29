"""`evalbus schemas [--out DIR] [--docs DIR] [--check]`: write the JSON Schema of every event (and
of the batch spec) to `docs/schemas/` and the field tables of the suite and harness references
(`docs/suites.md`, `docs/harness.md`), or check that the committed files match the code."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from evalbus.cli.reference import reference_drift, write_reference
from evalbus_contracts.schema import schemas

DEFAULT_OUT = Path("docs/schemas")
"""Where the schemas are committed."""
DEFAULT_DOCS = Path("docs")
"""Where the reference docs with generated field tables are."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `schemas` parser."""
    parser = commands.add_parser(
        "schemas",
        help="write (or --check) the JSON Schemas of the events and the reference docs' field tables",
        description="Write the JSON Schema of every event and of the batch spec, one file each, and the "
        "generated field tables of docs/suites.md and docs/harness.md.",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder (default: docs/schemas)")
    parser.add_argument(
        "--docs", type=Path, default=DEFAULT_DOCS, help="folder of suites.md and harness.md (default: docs)"
    )
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the files drifted")
    parser.set_defaults(run=run)


def render_schemas() -> dict[str, str]:
    """File name → file text, exactly as committed (sorted keys, two-space indent, final newline)."""
    return {name: json.dumps(schema, indent=2, sort_keys=True) + "\n" for name, schema in sorted(schemas().items())}


def drift(out: Path) -> list[str]:
    """Files in `out` that differ from the code: missing, changed or stale (empty when in sync)."""
    wanted = render_schemas()
    present = {p.name: p.read_text() for p in sorted(out.glob("*.json"))} if out.is_dir() else {}
    problems = [f"missing {name}" for name in wanted if name not in present]
    problems += [f"changed {name}" for name, text in wanted.items() if name in present and present[name] != text]
    problems += [f"stale {name}" for name in present if name not in wanted]
    return problems


def write_schemas(out: Path) -> list[str]:
    """Write every schema into `out` and delete stale `*.json` files; return the names written."""
    out.mkdir(parents=True, exist_ok=True)
    wanted = render_schemas()
    for stale in out.glob("*.json"):
        if stale.name not in wanted:
            stale.unlink()
    for name, text in wanted.items():
        path = out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return list(wanted)


def run(args: argparse.Namespace) -> int:
    """Write or check the schemas."""
    if args.check:
        problems = drift(args.out) + reference_drift(args.docs)
        for line in problems:
            print(line)
        if problems:
            print(f"{args.out} or the references in {args.docs} drifted from the contracts: run `just schemas`")
            return 1
        print(f"{args.out} and the references in {args.docs} match the contracts")
        return 0
    names = write_schemas(args.out)
    print(f"wrote {len(names)} schemas to {args.out}")
    for path in write_reference(args.docs):
        print(f"rewrote the field tables of {path}")
    return 0
