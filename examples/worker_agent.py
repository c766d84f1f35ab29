"""A Python agent served as a warm worker harness (`harness: {kind: worker, python:
worker_agent.py:solve}`, see examples/worker.yaml): the dispatcher keeps one of these processes per
compute slot and hands it one case at a time, so nothing is imported or started per case.

It answers arithmetic questions ("What is 6 * 7?") with a calculator tool and reports each step
through `ctx` (a user message, the tool call and its result), which becomes the run's trace. No
model is called: it is the zero-latency agent `bench/throughput.py --harness worker` measures.
It also writes `answer.txt` in the case's workdir, for sandbox graders.

Run it by hand over the worker protocol:
`python -m evalbus.harness examples/worker_agent.py:solve`, then type a case line
(`{"type": "case", "run_id": "r1", "case_id": "c1", "input": "What is 2 + 2?", "workdir": ".",
"input_file": "/dev/null", "timeout_s": 10}`).
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from pathlib import Path

from evalbus import Answer, harness
from evalbus.harness import Case, Context

_OPERATORS: dict[type[ast.AST], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_EXPRESSION = re.compile(r"[-+*/() .\d]+")


def calculate(expression: str) -> float:
    """The value of an arithmetic expression (numbers, + - * / and parentheses only)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not arithmetic: {ast.dump(node)}")

    return value(ast.parse(expression, mode="eval").body)


def number(x: float) -> str:
    """`4` for 4.0, `2.5` for 2.5."""
    return str(int(x)) if x == int(x) else f"{x:g}"


@harness
def solve(case: Case, ctx: Context) -> Answer:
    """Find the arithmetic in the question, compute it with the calculator tool, answer the number."""
    ctx.message("user", case.input)
    found = max(_EXPRESSION.findall(case.input.split("?")[0]), key=len, default="").strip()
    call = ctx.tool_call("calculator", {"expression": found})
    try:
        result = number(calculate(found))
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        ctx.tool_result(call, str(e), ok=False)
        result = "I don't know"
    else:
        ctx.tool_result(call, result)
    Path("answer.txt").write_text(result + "\n")
    return Answer(result)
