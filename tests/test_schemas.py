"""The committed JSON Schemas in `docs/schemas/` are exactly what the contracts generate now."""

from __future__ import annotations

from pathlib import Path

import pytest

from evalbus.cli.schemas import drift, render_schemas
from evalbus_contracts import EVENT_TYPES

pytestmark = pytest.mark.unit

SCHEMAS = Path(__file__).resolve().parents[1] / "docs" / "schemas"


def test_committed_schemas_match_the_contracts() -> None:
    problems = drift(SCHEMAS)
    assert not problems, f"docs/schemas drifted from the contracts ({', '.join(problems)}): run `just schemas`"


def test_there_is_one_schema_per_event_and_per_spec() -> None:
    names = set(render_schemas())
    specs = {"batch-spec.json", "online-suite.json", "object-ref.json"}
    assert names == {f"{k.__struct_config__.tag}.json" for k in EVENT_TYPES} | specs


def test_drift_reports_missing_changed_and_stale_files(tmp_path: Path) -> None:
    rendered = render_schemas()
    first, second, *rest = sorted(rendered)
    for name in rest:
        (tmp_path / name).write_text(rendered[name])
    (tmp_path / second).write_text(rendered[second].replace('"type"', '"typo"', 1))
    (tmp_path / "gone.json").write_text("{}\n")
    assert sorted(drift(tmp_path)) == sorted([f"missing {first}", f"changed {second}", "stale gone.json"])
