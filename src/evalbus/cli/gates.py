"""CI gates of `evalbus run`: the suite's `gates:` plus every `--gate EXPR`, checked once the
batch has finalized `succeeded`, each printed pass or fail with what it measured.

    gates     2 of 3 passed
      PASS  verdicts.pass_rate >= 0.8               measured 0.8 (needs >= 0.8)
      PASS  metric.cost_usd.mean <= 0.05            measured 0.0123 (needs <= 0.05)
      FAIL  no_significant_regression: answer_match against b8854eb1fb353: answer_match regressed: Δ -0.667 …

A threshold reads the batch's summary; a regression gate compares the batch with its baseline
(`GET /v1/compare`; the suite's baseline unless the gate names one). A gate that does not parse is
refused before anything is submitted (exit 2, naming it); the language is `evalbus_grading.gates`.

Exit codes on top of `run`'s: **3** when the batch succeeded and any gate failed. A batch that
failed or was cancelled exits 1 as before, and its gates are not checked.

`--junit FILE` and `--summary-md FILE` write the reports of `evalbus.cli.reports` once the batch
has finalized (a report that cannot be written is an error: exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import msgspec

from evalbus.cli.follow import EXIT_FINALIZED, EXIT_NOT_SUCCEEDED, Outcome, error_line, print_outcome
from evalbus.cli.reports import junit_xml, summary_markdown
from evalbus.cli.scorecard import json_line
from evalbus_api.client import ApiRequestError, GatewayClient
from evalbus_api.views import BatchView
from evalbus_contracts import BatchSpec, BatchSummary, GateSpec, to_builtins
from evalbus_grading.compare import Comparison
from evalbus_grading.gates import (
    GateError,
    GateResult,
    NoRegression,
    decide_regression,
    decide_threshold,
    parse_gate,
)

EXIT_GATE_FAILED = 3
"""The batch finalized `succeeded` and at least one gate failed."""


class GateOptionError(Exception):
    """A `--gate` expression that does not parse."""

    def __init__(self, expression: str, message: str) -> None:
        super().__init__(message)
        self.expression = expression
        """The option's value."""
        self.message = message
        """What is wrong."""


def add_gate_options(parser: argparse.ArgumentParser) -> None:
    """`--gate EXPR` (repeatable)."""
    parser.add_argument(
        "--gate",
        action="append",
        default=[],
        metavar="EXPR",
        help="a CI gate checked once the batch finalized, on top of the suite's gates: a threshold such as "
        "'verdicts.pass_rate >= 0.8' or 'metric.cost_usd.mean <= 0.05', or "
        "'no_significant_regression: answer_match, verdicts' (against the suite's baseline); a failing gate "
        "exits 3 (repeatable)",
    )
    parser.add_argument(
        "--junit", type=Path, metavar="FILE", help="write a JUnit XML report: a test case per run and per gate"
    )
    parser.add_argument(
        "--summary-md", type=Path, metavar="FILE", help="write a Markdown summary (e.g. $GITHUB_STEP_SUMMARY)"
    )


@dataclass(frozen=True, slots=True)
class ReportFiles:
    """Where `--junit` and `--summary-md` write (None: not asked for)."""

    junit: Path | None = None
    summary_md: Path | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> ReportFiles:
        """From `run`'s arguments."""
        return cls(junit=args.junit, summary_md=args.summary_md)

    def write(self, outcome: Outcome, results: Sequence[GateResult] | None) -> bool:
        """Write the reports asked for; False (after saying why) when one cannot be written."""
        view, runs, expected = outcome.view, outcome.runs, outcome.progress.expected
        for path, render in ((self.junit, junit_xml), (self.summary_md, summary_markdown)):
            if path is None:
                continue
            try:
                path.write_text(render(view, runs, expected, results), encoding="utf-8")
            except OSError as e:
                error_line(f"evalbus run: cannot write {path}: {e}")
                return False
        return True


def with_gate_options(spec: BatchSpec, expressions: Sequence[str]) -> BatchSpec:
    """`spec` with the `--gate` expressions added after its own gates (so the batch records them);
    `GateOptionError` for the first that does not parse."""
    for expression in expressions:
        try:
            parse_gate(expression)
        except GateError as e:
            raise GateOptionError(expression, str(e)) from None
    if not expressions:
        return spec
    return msgspec.structs.replace(spec, gates=(*spec.gates, *expressions))


class _Comparisons:
    """The comparisons regression gates need, fetched once per base."""

    def __init__(self, client: GatewayClient, view: BatchView) -> None:
        self._client = client
        self._view = view
        self._found: dict[str | None, tuple[Comparison | None, str]] = {}

    async def against(self, base: str | None) -> tuple[Comparison | None, str]:
        """The batch compared with `base` (None: its suite's baseline), or None and why not."""
        if base not in self._found:
            self._found[base] = await self._fetch(base)
        return self._found[base]

    async def _fetch(self, base: str | None) -> tuple[Comparison | None, str]:
        suite = self._view.suite_id or "?"
        if base is None:
            try:
                base = (await self._client.baseline(suite)).batch_id
            except ApiRequestError as e:
                if e.status == 404:
                    return None, f"suite {suite} has no baseline to compare with (evalbus baseline set {suite} BATCH)"
                return None, f"reading the baseline of {suite} failed: {e.status} {e.code}: {e.message}"
        try:
            return await self._client.compare(self._view.batch_id, base), ""
        except ApiRequestError as e:
            return None, f"comparing with {base} failed: {e.status} {e.code}: {e.message}"


async def decide_gates(client: GatewayClient, view: BatchView, gates: Sequence[GateSpec]) -> list[GateResult]:
    """Every gate of a finalized batch, decided."""
    summary = view.summary or BatchSummary()
    comparisons = _Comparisons(client, view)
    results = []
    for spec in gates:
        gate = parse_gate(spec)
        if isinstance(gate, NoRegression):
            comparison, why = await comparisons.against(gate.baseline)
            results.append(decide_regression(gate, comparison, why))
        else:
            results.append(decide_threshold(gate, summary))
    return results


def gate_lines(results: Sequence[GateResult]) -> list[str]:
    """The gates block of the scorecard."""
    passed = sum(1 for r in results if r.passed)
    width = max(len(r.gate) for r in results)
    lines = [f"gates     {passed} of {len(results)} passed"]
    lines += [f"  {'PASS' if r.passed else 'FAIL'}  {r.gate.ljust(width)}  {r.detail}".rstrip() for r in results]
    return lines


async def report_outcome(
    client: GatewayClient,
    outcome: Outcome,
    gates: Sequence[GateSpec],
    *,
    json_output: bool,
    out: TextIO = sys.stdout,
    files: ReportFiles = ReportFiles(),  # noqa: B008 - frozen, never mutated
) -> int:
    """Print the outcome — the scorecard, or the JSON line — with the gates when the batch
    succeeded, and write the reports asked for; the exit code (3 when a gate failed)."""
    view = outcome.view
    if not gates or outcome.exit_code != EXIT_FINALIZED:
        print_outcome(outcome, json_output=json_output, out=out)
        if gates and not json_output:
            out.write(f"gates     not checked: the batch finalized {view.status}\n")
        if not files.write(outcome, None):
            return EXIT_NOT_SUCCEEDED
        return outcome.exit_code
    results = await decide_gates(client, view, gates)
    if json_output:
        doc = json_line(view.batch_id, view.status, view.summary, gates=[to_builtins(r) for r in results])
        out.write(json.dumps(doc) + "\n")
    else:
        print_outcome(outcome, json_output=False, out=out)
        out.write("\n" + "\n".join(gate_lines(results)) + "\n")
    out.flush()
    if not files.write(outcome, results):
        return EXIT_NOT_SUCCEEDED
    return EXIT_FINALIZED if all(r.passed for r in results) else EXIT_GATE_FAILED
