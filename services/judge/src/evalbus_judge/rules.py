"""Rule judges: deterministic checks of the answer against the case's `expected` value.

Each scores 1.0 (pass) or 0.0 (fail). A rule that needs `expected` and has none is
`unmeasured: missing_evidence`; a rule whose own configuration is unusable (a bad pattern, an
unsupported schema) is `unmeasured` for every case rather than a failed case. A missing answer is a
real outcome — the agent said nothing — and fails the rule.
"""

from __future__ import annotations

import re

from evalbus_contracts import (
    ContainsJudge,
    ExactJudge,
    JsonSchemaJudge,
    NumericJudge,
    RegexJudge,
    Score,
)
from evalbus_judge.context import JudgeContext, clip, unmeasured, verdict
from evalbus_judge.json_schema import first_violation, schema_problems
from evalbus_judge.jsontext import find_json

EXCERPT = 120
"""Characters of the answer or expected value quoted in a detail."""

NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+|(?<=\d))(?:[eE][-+]?\d+)?")
"""A decimal number: optional sign, optional thousands separators, optional fraction and exponent.
A sign or digit glued to a preceding word character or dot does not start a number."""


def _quote(text: str) -> str:
    return repr(clip(text, EXCERPT))


def _missing_expected(judge_id: str) -> Score:
    return unmeasured(judge_id, "missing_evidence", "the case has no expected value")


def first_number(text: str) -> float | None:
    """The first number written in `text`, or None."""
    match = NUMBER.search(text)
    return None if match is None else float(match.group(0).replace(",", ""))


class ExactRule:
    """`exact`: the answer equals `expected` (whitespace-stripped and case-folded unless configured)."""

    def __init__(self, spec: ExactJudge) -> None:
        self.spec = spec

    def _normal(self, text: str) -> str:
        text = text.strip() if self.spec.strip else text
        return text if self.spec.case_sensitive else text.casefold()

    async def judge(self, ctx: JudgeContext) -> Score:
        """Score `ctx.answer` against `ctx.expected`."""
        if ctx.expected is None:
            return _missing_expected(self.spec.id)
        answer = ctx.answer or ""
        passed = self._normal(answer) == self._normal(ctx.expected)
        relation = "equals" if passed else "differs from"
        return verdict(self.spec.id, passed, f"answer {_quote(answer)} {relation} expected {_quote(ctx.expected)}")


class ContainsRule:
    """`contains`: the answer contains `expected`. An empty `expected` would pass every answer, so
    it counts as missing."""

    def __init__(self, spec: ContainsJudge) -> None:
        self.spec = spec

    async def judge(self, ctx: JudgeContext) -> Score:
        """Score whether `ctx.answer` contains `ctx.expected`."""
        if ctx.expected is None or not ctx.expected.strip():
            return _missing_expected(self.spec.id)
        answer, needle = ctx.answer or "", ctx.expected
        if not self.spec.case_sensitive:
            answer, needle = answer.casefold(), needle.casefold()
        passed = needle in answer
        relation = "contains" if passed else "does not contain"
        return verdict(self.spec.id, passed, f"answer {relation} {_quote(ctx.expected)}")


class RegexRule:
    """`regex`: the pattern (or, without one, `expected` as a pattern) is found in the answer."""

    def __init__(self, spec: RegexJudge) -> None:
        self.spec = spec
        self._compiled: re.Pattern[str] | None = None
        self._error: str | None = None
        if spec.pattern is not None:
            self._compiled, self._error = _compile(spec.pattern)

    async def judge(self, ctx: JudgeContext) -> Score:
        """Score whether the pattern is found in `ctx.answer`."""
        if self.spec.pattern is None:
            if ctx.expected is None or not ctx.expected:
                return _missing_expected(self.spec.id)
            compiled, error = _compile(ctx.expected)
        else:
            compiled, error = self._compiled, self._error
        if compiled is None:
            return unmeasured(self.spec.id, "grader_error", f"invalid pattern: {error}")
        passed = compiled.search(ctx.answer or "") is not None
        relation = "matches" if passed else "does not match"
        return verdict(self.spec.id, passed, f"answer {relation} /{clip(compiled.pattern, EXCERPT)}/")


def _compile(pattern: str) -> tuple[re.Pattern[str] | None, str | None]:
    try:
        return re.compile(pattern), None
    except re.error as e:
        return None, str(e)


class JsonSchemaRule:
    """`json-schema`: the answer (or a fenced JSON block in it) is JSON valid against the schema.
    A schema outside the supported subset makes the judge `unsupported` instead of half-checked."""

    def __init__(self, spec: JsonSchemaJudge) -> None:
        self.spec = spec
        self.problems = schema_problems(spec.json_schema)

    async def judge(self, ctx: JudgeContext) -> Score:
        """Validate `ctx.answer` against the schema."""
        if self.problems:
            return unmeasured(self.spec.id, "unsupported", "schema not supported: " + "; ".join(self.problems))
        found, value = find_json(ctx.answer or "")
        if not found:
            return verdict(self.spec.id, False, "answer is not JSON")
        violation = first_violation(value, self.spec.json_schema)
        if violation is not None:
            return verdict(self.spec.id, False, violation)
        return verdict(self.spec.id, True, "answer is valid against the schema")


class NumericRule:
    """`numeric`: the first number in the answer is within tolerance of `expected` — absolute by
    default, relative to |expected| when `relative` (so an expected 0 then needs an exact 0)."""

    def __init__(self, spec: NumericJudge) -> None:
        self.spec = spec

    async def judge(self, ctx: JudgeContext) -> Score:
        """Compare the first number in `ctx.answer` with `ctx.expected`."""
        judge_id, spec = self.spec.id, self.spec
        if not (spec.tolerance >= 0):
            return unmeasured(judge_id, "grader_error", f"tolerance must be >= 0, got {spec.tolerance}")
        if ctx.expected is None:
            return _missing_expected(judge_id)
        match = NUMBER.fullmatch(ctx.expected.strip())
        if match is None:
            return unmeasured(judge_id, "missing_evidence", f"expected {_quote(ctx.expected)} is not a number")
        expected = float(match.group(0).replace(",", ""))
        got = first_number(ctx.answer or "")
        if got is None:
            return verdict(judge_id, False, "no number in the answer")
        allowed = spec.tolerance * abs(expected) if spec.relative else spec.tolerance
        diff = abs(got - expected)
        passed = diff <= allowed
        kind = "relative" if spec.relative else "absolute"
        relation = "within" if passed else "outside"
        return verdict(
            judge_id,
            passed,
            f"answer {got:g} vs expected {expected:g}: |diff| {diff:g} {relation} {kind} tolerance {spec.tolerance:g}",
        )
