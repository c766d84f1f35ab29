"""The metric name each grader kind reports (as documented on the grader specs)."""

from __future__ import annotations

from evalbus_contracts import (
    AnswerMatchGrader,
    CommandGrader,
    CostGrader,
    GraderSpec,
    LatencyGrader,
    ScriptScoreGrader,
    StepsGrader,
    TestsPassGrader,
    TextMetricGrader,
)


def metric_of(grader: GraderSpec) -> str:
    """The metric a grader's score carries."""
    match grader:
        case TestsPassGrader():
            return "tests_pass"
        case AnswerMatchGrader():
            return "answer_match"
        case StepsGrader():
            return "tool_calls"
        case CostGrader():
            return "cost_usd"
        case LatencyGrader():
            return "latency_s"
        case CommandGrader() | ScriptScoreGrader() | TextMetricGrader():
            return grader.metric
