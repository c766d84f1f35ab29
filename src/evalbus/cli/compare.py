"""`evalbus compare [BASE] CANDIDATE`: is the candidate batch better or worse than the base?

    evalbus compare b8854eb1fb353 b41eab248147f
    evalbus compare b41eab248147f            # against the candidate suite's baseline

Prints the gateway's comparison (`GET /v1/compare`): per metric the base and candidate values
over the cases both batches measured, the delta with its 95 % interval, the paired test's p-value,
the Benjamini–Hochberg q-value and the change (`regressed` / `improved` when significant), then
the regressed and improved cases with both answers. `--json` prints the comparison as one JSON
line. Exit codes: 0 compared (whatever it found), 1 a batch is unknown, not finalized, has no
baseline, or the gateway could not be used, 2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence

from evalbus.cli.connection import add_gateway_options
from evalbus.cli.follow import (
    EXIT_BAD_INPUT,
    EXIT_FINALIZED,
    EXIT_NOT_SUCCEEDED,
    api_failure,
    error_line,
    resolve_target,
)
from evalbus.cli.scorecard import clip, number, table
from evalbus_api.client import ApiRequestError, GatewayClient
from evalbus_contracts import Measured, to_builtins
from evalbus_grading.compare import CaseComparison, CaseSide, Comparison, MetricComparison

MAX_CASES_SHOWN = 20
"""Regressed (and improved) cases listed by name; the rest are counted."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `compare` parser."""
    parser = commands.add_parser(
        "compare",
        help="compare a candidate batch with a base batch (default: the suite's baseline)",
        description="Per metric: base and candidate values, the delta with its 95 % interval, a paired test "
        "(exact McNemar or Wilcoxon signed-rank), the Benjamini-Hochberg q-value and whether it is significant; "
        "then the regressed and improved cases with both answers. With one batch, it is compared with its "
        "suite's baseline. Exit 0 when compared, 1 when it could not be, 2 on bad input.",
    )
    parser.add_argument("batches", nargs="+", metavar="BATCH", help="[BASE] CANDIDATE")
    parser.add_argument("--json", action="store_true", help="print the comparison as one JSON line")
    add_gateway_options(parser)
    parser.set_defaults(run=run)


def signed(value: float | None) -> str:
    """A delta with its sign."""
    if value is None:
        return "-"
    text = number(abs(value))
    return ("-" if value < 0 else "+") + text


def p_text(value: float | None) -> str:
    """A p- or q-value."""
    if value is None:
        return "-"
    return "<0.0001" if value < 0.0001 else f"{value:.4f}"


def value_text(row: MetricComparison, value: float | None) -> str:
    """A base or candidate value: a percentage for a pass rate, else a number."""
    if value is None:
        return "-"
    return f"{value * 100:.1f}%" if row.statistic == "pass_rate" else number(value)


def delta_text(row: MetricComparison, value: float | None) -> str:
    """A delta or an interval bound: percentage points for a pass rate."""
    if value is None:
        return "-"
    if row.statistic == "pass_rate":
        return f"{value * 100:+.1f}pp"
    return signed(value)


def metric_lines(comparison: Comparison) -> list[str]:
    """The per-metric table."""
    rows = [("METRIC", "N", "BASE", "CANDIDATE", "DELTA", "95% CI", "TEST", "P", "Q", "CHANGE")]
    for m in comparison.metrics:
        interval = "-" if m.ci_low is None else f"{delta_text(m, m.ci_low)} … {delta_text(m, m.ci_high)}"
        change = m.change if m.change != "unchanged" else ("not significant" if m.p_value is not None else "no pairs")
        rows.append(
            (
                m.metric,
                str(m.n),
                value_text(m, m.base),
                value_text(m, m.candidate),
                delta_text(m, m.delta),
                interval,
                m.test or "-",
                p_text(m.p_value),
                p_text(m.q_value),
                change.upper() if m.change == "regressed" else change,
            )
        )
    return table(rows, right=frozenset({1, 2, 3, 4, 7, 8}))


def side_text(side: CaseSide | None) -> str:
    """One side of a case: its verdicts and its answers."""
    if side is None:
        return "-"
    verdicts = [r.verdict for r in side.runs if r.verdict is not None]
    if not verdicts:
        head = "no verdict"
    elif len(side.runs) == 1:
        head = verdicts[0]
    else:
        head = f"{sum(1 for v in verdicts if v == 'pass')}/{len(verdicts)} pass"
    answers = list(dict.fromkeys(clip(r.answer, 24) for r in side.runs))
    return f"{head} {', '.join(answers[:3])}" + (" …" if len(answers) > 3 else "")


def failing_metrics(case: CaseComparison) -> str:
    """The pass/fail metrics the candidate failed that the base passed (for a regressed case)."""

    def passed(side: CaseSide | None) -> dict[str, bool]:
        out: dict[str, bool] = {}
        for run in side.runs if side is not None else ():
            for s in run.scores:
                if isinstance(s, Measured) and s.passed is not None:
                    out[s.metric] = out.get(s.metric, False) or s.passed
        return out

    base, candidate = passed(case.base), passed(case.candidate)
    lost = sorted(m for m, ok in base.items() if ok and candidate.get(m) is False)
    return ", ".join(lost)


def case_lines(title: str, cases: Sequence[CaseComparison], *, limit: int = MAX_CASES_SHOWN) -> list[str]:
    """A bucket of cases with both sides."""
    if not cases:
        return []
    rows = [("CASE", "BASE", "CANDIDATE", "NO LONGER PASSES" if title == "regressed" else "")]
    for case in cases[:limit]:
        rows.append((case.case_id, side_text(case.base), side_text(case.candidate), failing_metrics(case)))
    out = [f"{title} cases ({len(cases)})", *table(rows, indent="  ")]
    if len(cases) > limit:
        out.append(f"  … and {len(cases) - limit} more (--json lists them all)")
    return out


def render_comparison(comparison: Comparison) -> str:
    """The whole comparison as text."""
    c = comparison.cases
    base = f"{comparison.base}" + (f" (the baseline of {comparison.base_suite})" if comparison.baseline else "")
    head = [
        f"candidate {comparison.candidate}"
        + (f"  suite {comparison.candidate_suite}" if comparison.candidate_suite else "")
        + f"  against base {base}",
        f"cases     {len(c.regressed)} regressed, {len(c.improved)} improved, {len(c.unchanged)} unchanged, "
        f"{len(c.no_verdict)} without a verdict on a side, {len(c.only_in_base)} only in base, "
        f"{len(c.only_in_candidate)} only in candidate",
        "",
    ]
    paired = len(c.regressed) + len(c.improved) + len(c.unchanged) + len(c.no_verdict)
    suites = (comparison.base_suite, comparison.candidate_suite)
    if None not in suites and suites[0] != suites[1]:
        head.insert(-1, f"note      the batches ran different suites ({suites[0]}, {suites[1]}): cases pair by id")
    significant = [m for m in comparison.metrics if m.significant]
    if paired == 0:
        verdict = "nothing to compare: no case is in both batches"
    elif significant:
        verdict = f"significant (q < {comparison.alpha:g}): " + ", ".join(f"{m.metric} {m.change}" for m in significant)
    else:
        verdict = f"no significant change (q < {comparison.alpha:g})"
    lines = [*head, *metric_lines(comparison), "", verdict]
    for title, bucket in (("regressed", c.regressed), ("improved", c.improved)):
        block = case_lines(title, bucket)
        if block:
            lines += ["", *block]
    for title, bucket in (("only in base", c.only_in_base), ("only in candidate", c.only_in_candidate)):
        if bucket:
            names = ", ".join(x.case_id for x in bucket[:MAX_CASES_SHOWN])
            more = f" … and {len(bucket) - MAX_CASES_SHOWN} more" if len(bucket) > MAX_CASES_SHOWN else ""
            lines.append(f"{title}: {names}{more}")
    return "\n".join(lines)


async def compare_command(client: GatewayClient, base: str | None, candidate: str, *, json_output: bool) -> int:
    """Fetch and print the comparison; the exit code."""
    try:
        comparison = await client.compare(candidate, base)
    except ApiRequestError as e:
        if base is None and e.status == 404 and e.field == "base":  # the API's advice is for API callers
            error_line(
                f"evalbus compare: {candidate}'s suite has no baseline: compare two batches "
                "(evalbus compare BASE CANDIDATE) or set one (evalbus baseline set SUITE BATCH)"
            )
            return EXIT_NOT_SUCCEEDED
        code, message = api_failure(e, "evalbus compare")
        error_line(message)
        return code
    if json_output:
        print(json.dumps(to_builtins(comparison)))
    else:
        print(render_comparison(comparison))
    return EXIT_FINALIZED


async def _main(args: argparse.Namespace, base: str | None, candidate: str) -> int:
    target = resolve_target("compare", args.dir, args.gateway, args.token)
    if target is None:
        return 1
    async with GatewayClient(target.url, target.token) as client:
        return await compare_command(client, base, candidate, json_output=args.json)


def run(args: argparse.Namespace) -> int:
    """Compare; the exit code."""
    batches: list[str] = args.batches
    if len(batches) > 2:
        error_line("evalbus compare: give [BASE] CANDIDATE (one or two batch ids)")
        return EXIT_BAD_INPUT
    base, candidate = (None, batches[0]) if len(batches) == 1 else (batches[0], batches[1])
    return asyncio.run(_main(args, base, candidate))
