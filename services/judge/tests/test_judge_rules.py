"""Rule judges (exact, contains, regex, json-schema, numeric) against the case's expected value."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evalbus_contracts import (
    CaseResult,
    ContainsJudge,
    ExactJudge,
    JsonSchemaJudge,
    Measured,
    Message,
    NumericJudge,
    PromptSnapshot,
    RegexJudge,
    Score,
    Unmeasured,
)
from evalbus_judge import ContainsRule, ExactRule, JsonSchemaRule, JudgeContext, NumericRule, RegexRule
from evalbus_judge.rules import first_number

pytestmark = pytest.mark.unit


def ctx(answer: str | None, expected: str | None = None) -> JudgeContext:
    result = CaseResult(case_id="c1", run_id="evb-b1-c1", harness="h@1", answer=answer)
    return JudgeContext.of(result, case_input="the task", expected=expected)


def assert_verdict(score: Score, passed: bool, judge_id: str = "r") -> Measured:
    assert isinstance(score, Measured), score
    assert score.passed is passed
    assert score.value == (1.0 if passed else 0.0)
    assert score.metric == f"judge:{judge_id}"
    assert score.grader_id == judge_id
    assert score.source == "judge"
    assert score.detail
    return score


def assert_unmeasured(score: Score, reason: str) -> Unmeasured:
    assert isinstance(score, Unmeasured), score
    assert score.reason == reason
    assert score.source == "judge"
    assert score.metric.startswith("judge:")
    return score


# ---------------------------------------------------------------- answer extraction


def test_answer_falls_back_to_snapshot_then_last_assistant_message() -> None:
    trace = (
        Message(role="user", text="question"),
        Message(role="assistant", text="first"),
        Message(role="assistant", text="final"),
    )
    from_trace = JudgeContext.of(
        CaseResult(case_id="c", run_id="r", harness="h", trace=trace), case_input=None, expected=None
    )
    assert from_trace.answer == "final"
    assert from_trace.case_input == "question"
    from_snapshot = JudgeContext.of(
        CaseResult(case_id="c", run_id="r", harness="h", trace=trace, snapshot=PromptSnapshot(output="snap")),
        case_input="given",
        expected=None,
    )
    assert from_snapshot.answer == "snap"
    assert from_snapshot.case_input == "given"


# ---------------------------------------------------------------- exact


@pytest.mark.parametrize(
    ("answer", "expected", "spec", "passed"),
    [
        ("Paris", "Paris", ExactJudge(id="r"), True),
        ("  paris\n", "PARIS", ExactJudge(id="r"), True),
        ("paris", "Paris", ExactJudge(id="r", case_sensitive=True), False),
        (" Paris", "Paris", ExactJudge(id="r", strip=False), False),
        ("Paris, France", "Paris", ExactJudge(id="r"), False),
        ("Straße", "STRASSE", ExactJudge(id="r"), True),
        ("", "", ExactJudge(id="r"), True),
        (None, "Paris", ExactJudge(id="r"), False),
    ],
)
async def test_exact(answer: str | None, expected: str, spec: ExactJudge, passed: bool) -> None:
    assert_verdict(await ExactRule(spec).judge(ctx(answer, expected)), passed)


async def test_exact_without_expected_is_missing_evidence() -> None:
    assert_unmeasured(await ExactRule(ExactJudge(id="r")).judge(ctx("Paris")), "missing_evidence")


# ---------------------------------------------------------------- contains


@pytest.mark.parametrize(
    ("answer", "expected", "case_sensitive", "passed"),
    [
        ("The capital is Paris.", "paris", False, True),
        ("The capital is Paris.", "paris", True, False),
        ("The capital is Lyon.", "Paris", False, False),
        (None, "Paris", False, False),
    ],
)
async def test_contains(answer: str | None, expected: str, case_sensitive: bool, passed: bool) -> None:
    spec = ContainsJudge(id="r", case_sensitive=case_sensitive)
    assert_verdict(await ContainsRule(spec).judge(ctx(answer, expected)), passed)


@pytest.mark.parametrize("expected", [None, "", "   "])
async def test_contains_without_usable_expected_is_missing_evidence(expected: str | None) -> None:
    score = await ContainsRule(ContainsJudge(id="r")).judge(ctx("anything", expected))
    assert_unmeasured(score, "missing_evidence")


# ---------------------------------------------------------------- regex


async def test_regex_pattern_from_spec_ignores_expected() -> None:
    rule = RegexRule(RegexJudge(id="r", pattern=r"\b\d{3}-\d{4}\b"))
    assert_verdict(await rule.judge(ctx("call 555-1234 now", expected=None)), True)
    assert_verdict(await rule.judge(ctx("call 5551234 now", expected="555")), False)
    assert_verdict(await rule.judge(ctx(None)), False)


async def test_regex_pattern_from_expected() -> None:
    rule = RegexRule(RegexJudge(id="r"))
    assert_verdict(await rule.judge(ctx("answer: 42", expected=r"answer:\s*4\d")), True)
    assert_verdict(await rule.judge(ctx("ANSWER: 42", expected=r"answer:\s*4\d")), False)
    assert_verdict(await rule.judge(ctx("ANSWER: 42", expected=r"(?i)answer:\s*4\d")), True)


async def test_regex_without_pattern_or_expected_is_missing_evidence() -> None:
    rule = RegexRule(RegexJudge(id="r"))
    assert_unmeasured(await rule.judge(ctx("x", expected=None)), "missing_evidence")
    assert_unmeasured(await rule.judge(ctx("x", expected="")), "missing_evidence")


async def test_invalid_regex_is_unmeasured_not_a_crash() -> None:
    from_spec = await RegexRule(RegexJudge(id="r", pattern="(unclosed")).judge(ctx("x"))
    assert "invalid pattern" in (assert_unmeasured(from_spec, "grader_error").detail or "")
    from_expected = await RegexRule(RegexJudge(id="r")).judge(ctx("x", expected="[a-"))
    assert_unmeasured(from_expected, "grader_error")


# ---------------------------------------------------------------- json-schema

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "an answer",
    "type": "object",
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
        "kind": {"const": "person"},
        "score": {"type": ["number", "null"]},
    },
}


@pytest.mark.parametrize(
    ("answer", "passed", "why"),
    [
        ('{"name": "Ada", "age": 36, "tags": ["a"]}', True, "valid"),
        ('{"name": "Ada", "age": 36.0, "tags": []}', True, "36.0 is an integer"),
        ('{"name": "Ada", "age": 36, "tags": [], "kind": "person", "score": null}', True, "valid with optionals"),
        ('Here you go:\n```json\n{"name": "Ada", "age": 1, "tags": ["b"]}\n```', True, "fenced"),
        ('{"name": "Ada", "tags": []}', False, "missing required property 'age'"),
        ('{"name": "Ada", "age": 36.5, "tags": []}', False, "expected integer"),
        ('{"name": "Ada", "age": true, "tags": []}', False, "expected integer, got boolean"),
        ('{"name": "Ada", "age": -1, "tags": []}', False, "below the minimum"),
        ('{"name": "Ada", "age": 151, "tags": []}', False, "above the maximum"),
        ('{"name": 7, "age": 1, "tags": []}', False, "$.name: expected string"),
        ('{"name": "Ada", "age": 1, "tags": ["c"]}', False, "$.tags[0]: must be one of"),
        ('{"name": "Ada", "age": 1, "tags": [], "kind": "robot"}', False, "$.kind: must equal"),
        ('{"name": "Ada", "age": 1, "tags": [], "score": "high"}', False, "expected number or null"),
        ('["not", "an", "object"]', False, "expected object, got array"),
        ("not json at all", False, "not JSON"),
        ("", False, "not JSON"),
        ('{"name": NaN}', False, "not JSON"),
    ],
)
async def test_json_schema(answer: str, passed: bool, why: str) -> None:
    score = assert_verdict(await JsonSchemaRule(JsonSchemaJudge(id="r", json_schema=SCHEMA)).judge(ctx(answer)), passed)
    if not passed:
        assert why in (score.detail or "")


async def test_json_schema_equality_is_json_equality() -> None:
    one = JsonSchemaRule(JsonSchemaJudge(id="r", json_schema={"enum": [1, "x", [1, 2], {"k": False}]}))
    assert_verdict(await one.judge(ctx("1.0")), True)
    assert_verdict(await one.judge(ctx("true")), False)  # true is not 1 in JSON
    assert_verdict(await one.judge(ctx("[1, 2]")), True)
    assert_verdict(await one.judge(ctx('{"k": false}')), True)
    assert_verdict(await one.judge(ctx('{"k": 0}')), False)
    never = JsonSchemaRule(JsonSchemaJudge(id="r", json_schema={"properties": {"x": False}}))
    assert_verdict(await never.judge(ctx('{"y": 1}')), True)
    assert_verdict(await never.judge(ctx('{"x": 1}')), False)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^a"},
        {"type": "object", "additionalProperties": False},
        {"properties": {"x": {"minLength": 3}}},
        {"type": "strnig"},
        {"required": "name"},
        {"items": 3},
    ],
)
async def test_json_schema_outside_the_subset_is_unsupported(schema: dict[str, object]) -> None:
    score = await JsonSchemaRule(JsonSchemaJudge(id="r", json_schema=schema)).judge(ctx('"abc"'))
    assert_unmeasured(score, "unsupported")


# ---------------------------------------------------------------- numeric


@pytest.mark.parametrize(
    ("answer", "expected", "spec", "passed"),
    [
        ("The answer is 42.", "42", NumericJudge(id="r"), True),
        ("42.0000001", "42", NumericJudge(id="r"), True),
        ("42.01", "42", NumericJudge(id="r"), False),
        ("about 3.14", "3.14159", NumericJudge(id="r", tolerance=0.01), True),
        ("about 3.2", "3.14159", NumericJudge(id="r", tolerance=0.01), False),
        ("1,050 units", "1000", NumericJudge(id="r", tolerance=0.05, relative=True), True),
        ("1,051 units", "1000", NumericJudge(id="r", tolerance=0.05, relative=True), False),
        ("-2.5e3", "-2500", NumericJudge(id="r"), True),
        ("0", "0", NumericJudge(id="r", tolerance=0.5, relative=True), True),
        ("0.001", "0", NumericJudge(id="r", tolerance=0.5, relative=True), False),
        ("first 7 then 42", "42", NumericJudge(id="r"), False),
        ("no digits here", "42", NumericJudge(id="r"), False),
        (None, "42", NumericJudge(id="r"), False),
        ("42", " 4.2e1 ", NumericJudge(id="r"), True),
    ],
)
async def test_numeric(answer: str | None, expected: str, spec: NumericJudge, passed: bool) -> None:
    assert_verdict(await NumericRule(spec).judge(ctx(answer, expected)), passed)


@pytest.mark.parametrize("expected", [None, "forty-two", "42 apples", ""])
async def test_numeric_without_a_numeric_expected_is_missing_evidence(expected: str | None) -> None:
    assert_unmeasured(await NumericRule(NumericJudge(id="r")).judge(ctx("42", expected)), "missing_evidence")


async def test_numeric_negative_tolerance_is_an_error_not_a_fail() -> None:
    score = await NumericRule(NumericJudge(id="r", tolerance=-1)).judge(ctx("42", "42"))
    assert_unmeasured(score, "grader_error")


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("x-2", 2.0),
        ("v1.2 then 7", 7.0),
        ("2024-01-05", 2024.0),
        ("$1,000,000", 1_000_000.0),
        ("1,2", 1.0),
        (".5", 0.5),
        ("-", None),
    ],
)
def test_first_number(text: str, number: float | None) -> None:
    assert first_number(text) == number


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_first_number_reads_back_any_written_float(x: float) -> None:
    got = first_number(f"result: {x!r} units")
    assert got is not None
    assert got == x or (x == 0 and got == 0)
    assert math.copysign(1, got) == math.copysign(1, x) or x == 0
