"""`evalbus init [DIR]`: a starter evaluation in DIR — an agent, a dataset and the suite that runs
one on the other — ready for `evalbus run suite.yaml` (docs/suites.md, "Your first evaluation").

The agent is a plain script on the harness contract (docs/harness.md): the task on stdin, one
`EVALBUS_EVENT` trace line, the answer on stdout. Existing files are never overwritten unless
`--force`; exit 2 naming them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

AGENT = '''"""A starter agent on evalbus's harness contract (docs/harness.md): the task arrives on stdin,
trace events are `EVALBUS_EVENT {json}` lines, and the last line of stdout is the answer."""

import json
import re
import sys

task = sys.stdin.read()
print("EVALBUS_EVENT " + json.dumps({"kind": "message", "role": "user", "text": task}), flush=True)

found = re.search(r"(-?\\d+)\\s*([-+*])\\s*(-?\\d+)", task)
if found is None:
    answer = "I don't know"
else:
    a, op, b = int(found[1]), found[2], int(found[3])
    answer = str(a + b if op == "+" else a - b if op == "-" else a * b)
    call = {"kind": "tool_call", "id": "calc-1", "name": "calculator", "args": {"expression": found[0]}}
    print("EVALBUS_EVENT " + json.dumps(call), flush=True)
    print("EVALBUS_EVENT " + json.dumps({"kind": "tool_result", "id": "calc-1", "output": answer}), flush=True)

print(answer)
'''

CASES = """{"qid": "add-1", "question": "What is 2 + 2?", "answer": "4"}
{"qid": "add-2", "question": "What is 3 + 5?", "answer": "8"}
{"qid": "mul-1", "question": "What is 6 * 7?", "answer": "42"}
{"qid": "sub-1", "question": "What is 10 - 4?", "answer": "6"}
{"qid": "capital", "question": "What is the capital of Australia?", "answer": "Canberra"}
"""

SUITE = """# A starter suite (docs/suites.md): the dataset's columns mapped to a case's fields, a grader
# that compares the answer with the expected one, a rule judge, and a JSONL export.
suite:
  id: starter
  dataset:
    path: cases.jsonl
    fields: {id: qid, input: question, expected: answer}
  graders:
  - {kind: answer-match, id: answer}
harness:
  kind: command
  id: starter-agent
  command: [python3, agent.py]
judges:
- {kind: exact, id: exact}
sinks:
- {kind: jsonl, path: '{batch}.jsonl'}
"""

FILES = {"agent.py": AGENT, "cases.jsonl": CASES, "suite.yaml": SUITE}
"""What `init` writes, by name."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `init` parser."""
    parser = commands.add_parser(
        "init",
        help="write a starter evaluation: an agent, a dataset and a suite",
        description="Write agent.py (a script on the harness contract), cases.jsonl (five cases) and suite.yaml "
        "(the dataset, a grader, a judge, a JSONL export) into DIR; then `evalbus up` and `evalbus run "
        "suite.yaml`. Existing files are left alone unless --force (exit 2 naming them).",
    )
    parser.add_argument("dir", nargs="?", type=Path, default=Path("."), help="the folder (default: this one)")
    parser.add_argument("--force", action="store_true", help="overwrite files of those names")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Write the starter files; 2 when one exists already (without --force) or DIR is no folder."""
    folder: Path = args.dir
    if folder.exists() and not folder.is_dir():
        print(f"evalbus init: {folder} is not a folder", file=sys.stderr)
        return 2
    existing = [name for name in FILES if (folder / name).exists()]
    if existing and not args.force:
        names = ", ".join(existing)
        verb = "exists" if len(existing) == 1 else "exist"
        print(
            f"evalbus init: {folder} has an evaluation already ({names} {verb}); nothing written: "
            "run it (evalbus run), init another folder, or --force to overwrite",
            file=sys.stderr,
        )
        return 2
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in FILES.items():
        (folder / name).write_text(text, encoding="utf-8")
    where = "" if folder == Path(".") else f"cd {folder} && "
    print(f"wrote {', '.join(FILES)} in {folder.resolve()}")
    print("next: evalbus up (once; it keeps running), then")
    print(f"      {where}evalbus run suite.yaml")
    return 0
