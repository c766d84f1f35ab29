"""`evalbus online apply` reads suites files: one suite, a list, or `{suites: [...]}`; the shipped
example is a valid suite."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from evalbus.cli.online import SuiteFileError, load_suites
from evalbus_contracts import RegexJudge

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "online-suite.yaml"


def test_the_example_suite_loads() -> None:
    [suite] = load_suites(EXAMPLE)
    assert suite.id == "support-bot-polite"
    assert suite.target.attributes == {"deployment.environment": "prod"}
    [judge] = suite.judges
    assert isinstance(judge, RegexJudge)
    assert judge.pattern is not None
    assert re.search(judge.pattern, "Thank you!")


@pytest.mark.parametrize(
    "text",
    [
        "id: a\ntarget: {service: s}\njudges: [{kind: exact, id: e}]\n",
        "- id: a\n  target: {service: s}\n  judges: [{kind: exact, id: e}]\n",
        "suites:\n  - id: a\n    target: {service: s}\n    judges: [{kind: exact, id: e}]\n",
    ],
)
def test_one_suite_a_list_or_a_mapping_of_suites(tmp_path: Path, text: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    assert [s.id for s in load_suites(path)] == ["a"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "expected a suite, a list of suites"),
        ("id: [", "cannot read it"),
        ("- id: a\n  target: {service: s}\n- target: 3\n", "$[1].target: Expected `object`, got `int`"),
        ("id: a\ntarget: {service: s}\nsample_ratio: many\n", "$.sample_ratio: Expected `float`, got `str`"),
        (
            "id: a\ntarget: {service: s}\nsample_ration: 0.5\n",
            "$.sample_ration: unknown field; did you mean `sample_ratio`?",
        ),
        ("suite: {id: s, cases: []}\nharness: {id: h, command: [x]}\n", "this is a batch suite (suite:, harness:)"),
    ],
)
def test_a_bad_file_names_the_suite_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SuiteFileError, match=re.escape(message)):
        load_suites(path)
