"""`docs/suites.md` and `docs/harness.md` cannot drift from the code: their field tables are what
the spec and trace structs generate now, every struct a suite file can hold (and every trace event
kind) has its table, every field has a docstring to fill it, and every variable the dispatcher
puts in a harness's environment is named in the harness contract."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from evalbus.cli import main
from evalbus.cli.reference import (
    REFERENCE_DOCS,
    blocks_in,
    documented_structs,
    reference_drift,
    render_doc,
    undocumented,
)
from evalbus_contracts import CasePlan, CaseRequested, CaseSpec
from evalbus_dispatcher.backends.local import INHERITED_ENV, run_environment
from evalbus_dispatcher.harness_output import EVENT_PREFIX, RESULT_PREFIX
from evalbus_gateway.testing import HARNESS

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_committed_field_tables_are_what_the_structs_generate() -> None:
    problems = reference_drift(DOCS)
    assert not problems, f"the reference docs drifted from the contracts ({', '.join(problems)}): run `just schemas`"


def test_every_struct_has_exactly_one_table() -> None:
    blocks = Counter(name for doc in REFERENCE_DOCS for name in blocks_in((DOCS / doc).read_text()))
    assert set(blocks) == set(documented_structs())
    assert [name for name, n in blocks.items() if n > 1] == []


def test_every_field_has_a_docstring_to_explain_it() -> None:
    assert [gap for cls in documented_structs().values() for gap in undocumented(cls)] == []


def test_a_stale_or_unknown_table_is_drift(tmp_path: Path) -> None:
    for name in REFERENCE_DOCS:
        (tmp_path / name).write_text((DOCS / name).read_text())
    assert reference_drift(tmp_path) == []
    suites = tmp_path / "suites.md"
    suites.write_text(suites.read_text().replace("| `trials` |", "| `trails` |"))
    (tmp_path / "harness.md").write_text("<!-- fields: NoSuchStruct -->\n<!-- /fields -->\n")
    assert reference_drift(tmp_path) == [
        f"changed {suites} (its field tables)",
        f"{tmp_path / 'harness.md'}: <!-- fields: NoSuchStruct --> names no documented struct",
    ]
    assert render_doc(suites.read_text()) == (DOCS / "suites.md").read_text()


def test_evalbus_schemas_writes_and_checks_the_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schemas, docs = tmp_path / "schemas", tmp_path / "docs"
    docs.mkdir()
    for name in REFERENCE_DOCS:
        text = (DOCS / name).read_text()
        (docs / name).write_text(text.replace("| `id` |", "| `old` |"))
    assert main(["schemas", "--out", str(schemas), "--docs", str(docs), "--check"]) == 1
    assert main(["schemas", "--out", str(schemas), "--docs", str(docs)]) == 0
    assert main(["schemas", "--out", str(schemas), "--docs", str(docs), "--check"]) == 0
    for name in REFERENCE_DOCS:
        assert (docs / name).read_text() == (DOCS / name).read_text()
    assert "rewrote the field tables" in capsys.readouterr().out


def test_the_harness_contract_names_every_variable_and_line_prefix() -> None:
    text = (DOCS / "harness.md").read_text()
    job = CaseRequested(
        batch_id="b1",
        case_id="c1",
        run_id="evb-b1-c1",
        case=CaseSpec(id="c1", input="x"),
        harness=HARNESS,
        plan=CasePlan(suite_id="s", submitted_by="alice"),
    )
    variables = set(run_environment(job, base={}, input_file=Path("/tmp/input.txt"))) | set(INHERITED_ENV)
    assert [v for v in sorted(variables) if f"`{v}`" not in text] == []
    assert f"{EVENT_PREFIX} " in text
    assert f"{RESULT_PREFIX} " in text
