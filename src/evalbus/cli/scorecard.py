"""The scorecard of a finalized batch as text (pure): per-metric table, verdicts, pass@k, flaky
cases, export, status, and the failed cases with their answer against the expected one. Means and
rates are shown with their 95 % intervals when the summary carries them (batches finalized before
intervals existed are shown without).

    batch b1a2b3c4d5e6f  suite demo-tools  30 runs  status succeeded

    METRIC        COUNT  MEAN   95% CI       PASS RATE  95% CI      UNMEASURED
    answer_match     30  0.800  0.627–0.905      80.0%  62.7–90.5%
    judge:rubric      0  -      -                    -  -           unsupported 30

    verdicts  24 passed, 6 failed, 0 without a verdict (pass rate 80.0%, 95% CI 62.7–90.5%)
    cost      agent $0.000369 (cost_usd over 30 runs)  judges $0.0450 (30 model calls, 12000 in / 600 out tokens)
    export    succeeded: 30 exported, 0 failed  file:///…/exports/b1a2b3c4d5e6f.jsonl

    failed cases (6 of 30)
      CASE         ANSWER      EXPECTED    FAILURE
      capital-02   'Sydney'    'Canberra'  verdict fail (ground_truth)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from evalbus_api.views import BatchView, RunView
from evalbus_contracts import BatchSummary, Interval, JudgeUsageSummary, TrialSummary, to_builtins

MAX_FAILED_SHOWN = 10
"""Failed cases listed by name; the rest are counted."""
MAX_FLAKY_SHOWN = 10
"""Flaky cases listed by name on the scorecard; the rest are counted."""
_CELL = 28
MAX_LOG_TAILS_SHOWN = 3
"""Failed runs whose log's last lines are printed under the failed cases."""
LOG_TAIL_LINES = 3
"""Lines of each of those logs."""
_MESSAGE = 72


def number(value: float | None) -> str:
    """A mean: 3 decimals, or 3 significant digits when that would hide it (costs, big counts)."""
    if value is None:
        return "-"
    if value != 0 and (abs(value) < 0.01 or abs(value) >= 10_000):
        return f"{value:.3g}"
    return f"{value:.3f}"


def percent(value: float | None) -> str:
    """A rate as a percentage."""
    return "-" if value is None else f"{value * 100:.1f}%"


def clip(text: str | None, width: int = _CELL) -> str:
    """A value for a table cell: quoted, on one line, shortened to `width`."""
    if text is None:
        return "-"
    shown = repr(text.strip())
    return shown if len(shown) <= width else shown[: width - 1] + "…"


def table(rows: Sequence[Sequence[str]], *, right: frozenset[int] = frozenset(), indent: str = "") -> list[str]:
    """Fixed-width columns (`right`: right-aligned column indexes), trailing spaces trimmed."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def number_range(ci: Interval | None) -> str:
    """An interval of means: `0.627–0.905`."""
    return "-" if ci is None else f"{number(ci.low)}–{number(ci.high)}"


def percent_range(ci: Interval | None) -> str:
    """An interval of rates: `62.7–90.5%`."""
    return "-" if ci is None else f"{ci.low * 100:.1f}–{ci.high * 100:.1f}%"


def metric_lines(summary: BatchSummary) -> list[str]:
    """The per-metric table (with interval columns when the summary has intervals)."""
    if not summary.metrics:
        return ["(no scores)"]
    intervals = any(m.mean_ci is not None or m.pass_rate_ci is not None for m in summary.metrics)
    if not intervals:
        rows = [("METRIC", "COUNT", "MEAN", "PASS RATE", "UNMEASURED")]
        for m in summary.metrics:
            unmeasured = ", ".join(f"{reason} {n}" for reason, n in sorted(m.unmeasured.items()))
            rows.append((m.metric, str(m.count), number(m.mean), percent(m.pass_rate), unmeasured))
        return table(rows, right=frozenset({1, 3}))
    wide = [("METRIC", "COUNT", "MEAN", "95% CI", "PASS RATE", "95% CI", "UNMEASURED")]
    for m in summary.metrics:
        unmeasured = ", ".join(f"{reason} {n}" for reason, n in sorted(m.unmeasured.items()))
        wide.append(
            (
                m.metric,
                str(m.count),
                number(m.mean),
                number_range(m.mean_ci),
                percent(m.pass_rate),
                percent_range(m.pass_rate_ci),
                unmeasured,
            )
        )
    return table(wide, right=frozenset({1, 4}))


def trial_lines(trials: TrialSummary) -> list[str]:
    """pass@1 and pass@k (with intervals and the unbiased pass@k per k when present), then the
    flaky cases."""
    first = f"pass@k    pass@1 {number(trials.pass_at_1)}"
    if trials.pass_at_1_ci is not None:
        first += f" [{number_range(trials.pass_at_1_ci)}]"
    first += f", pass@{trials.k} {number(trials.pass_at_k)}"
    if trials.pass_at_k_ci is not None:
        first += f" [{number_range(trials.pass_at_k_ci)}]"
    if trials.cases:
        first += f" over {trials.cases} cases"
    lines = [first]
    if trials.pass_at:
        estimates = ", ".join(f"pass@{p.k} {number(p.value)} [{number_range(p.ci)}]" for p in trials.pass_at)
        lines.append(f"          unbiased: {estimates}")
    if trials.flaky:
        names = ", ".join(trials.flaky_cases[:MAX_FLAKY_SHOWN])
        more = trials.flaky - min(len(trials.flaky_cases), MAX_FLAKY_SHOWN)
        lines.append(
            f"flaky     {trials.flaky} of {trials.cases} cases passed and failed across trials: {names}"
            + (f" … and {more} more" if more > 0 else "")
        )
    return lines


AGENT_COST_METRIC = "cost_usd"
"""The agent's own cost (the `cost` grader's metric), shown beside what its judges cost."""


def dollars(value: float) -> str:
    """An amount of US dollars: 4 decimals, or 3 significant digits below a cent (agents' and
    judges' costs are often fractions of one)."""
    return f"${value:.3g}" if 0 < value < 0.01 else f"${value:.4f}"


def judges_cost(usage: JudgeUsageSummary) -> str:
    """What the model judges cost: dollars (of the calls whose cost is known), calls and tokens."""
    calls = f"{usage.calls} model call{'s' if usage.calls != 1 else ''}"
    tokens = f"{usage.input_tokens} in / {usage.output_tokens} out tokens"
    if usage.cost_usd is None:
        return f"judges cost unmeasured (no price; {calls}, {tokens})"
    unpriced = f", {usage.unpriced_calls} without a price" if usage.unpriced_calls else ""
    return f"judges {dollars(usage.cost_usd)} ({calls}{unpriced}, {tokens})"


def cost_line(summary: BatchSummary) -> str | None:
    """The agent's cost (its `cost_usd` total, when measured) beside the model judges'; None when neither is known."""
    agent = next((m for m in summary.metrics if m.metric == AGENT_COST_METRIC and m.mean is not None), None)
    parts = []
    if agent is not None and agent.mean is not None:
        parts.append(f"agent {dollars(agent.mean * agent.count)} ({AGENT_COST_METRIC} over {agent.count} runs)")
    if summary.judge_usage is not None:
        parts.append(judges_cost(summary.judge_usage))
    return ("cost      " + "  ".join(parts)) if parts else None


def export_url(view: BatchView, runs: Sequence[RunView]) -> str | None:
    """The batch's link on its sink: the export summary's, else the one URL every run shares."""
    if view.export is not None and view.export.url:
        return view.export.url
    urls = {o.url for run in runs for o in run.export_outcomes if o.url}
    return urls.pop() if len(urls) == 1 else None


def failed_runs(runs: Sequence[RunView]) -> list[RunView]:
    """Runs that failed: a `fail` verdict or a failure, by run id."""
    return sorted((r for r in runs if r.verdict == "fail" or r.failure is not None), key=lambda r: r.run_id)


def why_failed(run: RunView) -> str:
    """The failure's code (class, stage) and message, else the verdict and the rung that decided it."""
    if run.failure is not None:
        failure = run.failure
        message = " ".join(failure.message.split())
        if len(message) > _MESSAGE:
            message = message[: _MESSAGE - 1] + "…"
        return f"{failure.code} ({failure.failure_class}, {failure.stage}): {message}"
    return f"verdict fail ({run.verdict_rung or 'no rung'})"


def log_tail_lines(failed: Sequence[RunView], limit: int = MAX_LOG_TAILS_SHOWN) -> list[str]:
    """The last lines of the logs of the first failed runs that left one (what a user reads first
    when a run failed to start or crashed)."""
    out: list[str] = []
    tails = [(r, r.failure.log_tail) for r in failed if r.failure is not None and r.failure.log_tail]
    for run, tail in [(r, t) for r, t in tails if t.strip()][:limit]:
        lines = [line for line in tail.splitlines() if line.strip()][-LOG_TAIL_LINES:]
        case = run.case_id + (f" #{run.trial}" if run.trial is not None else "")
        out.append(f"  {case}: the last lines of its log (evalbus tail, GET /v1/runs/{run.run_id}/logs)")
        out += [f"    | {_shortened(line)}" for line in lines]
    return out


def _shortened(line: str, width: int = 160) -> str:
    """A log line in `width` characters: its start and its end (an error's last words are the ones
    that say what went wrong), the middle elided."""
    if len(line) <= width:
        return line
    half = (width - 3) // 2
    return f"{line[:half]} … {line[-half:]}"


def failed_lines(
    runs: Sequence[RunView], expected: Mapping[str, str | None], limit: int = MAX_FAILED_SHOWN
) -> list[str]:
    """The short list of failed cases: answer against expected, and why."""
    failed = failed_runs(runs)
    if not failed:
        return []
    out = [f"failed cases ({len(failed)} of {len(runs)})"]
    rows = [("CASE", "ANSWER", "EXPECTED", "FAILURE")]
    for run in failed[:limit]:
        case = run.case_id + (f" #{run.trial}" if run.trial is not None else "")
        rows.append((case, clip(run.answer), clip(expected.get(run.case_id)), why_failed(run)))
    out += table(rows, indent="  ")
    if len(failed) > limit:
        out.append(f"  … and {len(failed) - limit} more (GET /v1/batches/<id>/cases)")
    out += log_tail_lines(failed[:limit])
    return out


def render_scorecard(view: BatchView, runs: Sequence[RunView], expected: Mapping[str, str | None]) -> str:
    """The whole scorecard."""
    summary = view.summary or BatchSummary()
    total = view.total_runs if view.total_runs is not None else len(runs)
    head = f"batch {view.batch_id}"
    if view.suite_id:
        head += f"  suite {view.suite_id}"
    head += f"  {total} runs"
    if view.trials and view.trials > 1:
        head += f" ({view.trials} trials per case)"
    head += f"  status {view.status}"
    lines = [head, "", *metric_lines(summary), ""]
    v = summary.verdicts
    rate = ""
    if v.pass_rate is not None:
        ci = f", 95% CI {percent_range(v.pass_rate_ci)}" if v.pass_rate_ci is not None else ""
        rate = f" (pass rate {percent(v.pass_rate)}{ci})"
    lines.append(f"verdicts  {v.passed} passed, {v.failed} failed, {v.no_verdict} without a verdict{rate}")
    if summary.trials is not None:
        lines += trial_lines(summary.trials)
    cost = cost_line(summary)
    if cost is not None:
        lines.append(cost)
    export = view.export
    if export is not None:
        text = f"export    {export.status}"
        if export.status != "skipped":
            text += f": {export.exported} exported, {export.failed} failed"
        url = export_url(view, runs)
        if url:
            text += f"  {url}"
        if export.message:
            text += f"  ({export.message})"
        lines.append(text)
    status = f"status    {view.status}"
    if view.cancel_reason is not None:
        status += f" (by {view.cancelled_by})" if view.cancelled_by else ""
    if view.error is not None:
        status += f": {view.error.code}: {view.error.message}" + (f" [{view.error.phase}]" if view.error.phase else "")
    lines.append(status)
    failed = failed_lines(runs, expected)
    if failed:
        lines += ["", *failed]
    return "\n".join(lines)


def json_line(batch_id: str, status: str, summary: BatchSummary | None, **extra: Any) -> dict[str, Any]:
    """The `--json` document: `{"batch_id", "status", "summary", …extra}`."""
    return {
        "batch_id": batch_id,
        "status": status,
        "summary": None if summary is None else to_builtins(summary),
        **extra,
    }
