"""The Python harness SDK: `@harness` on `def solve(case, ctx) -> str | Answer` (sync or async),
served as a warm worker (`python -m evalbus.harness module:function`, or `harness: {kind: worker,
python: module:function}` in a suite). The protocol and the whole contract: docs/harness.md."""

from evalbus.harness.sdk import Answer, Case, Context, Harness, harness, load_target, serve

__all__ = ["Answer", "Case", "Context", "Harness", "harness", "load_target", "serve"]
