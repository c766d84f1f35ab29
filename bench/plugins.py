"""Judge plugins for the benchmarks, loaded by the judge service with
`JUDGE_PLUGINS=bench.plugins:register` (the repository root on `PYTHONPATH`).

- `sleep`: waits `params.seconds` (default 1.0) without using the CPU, like a judge waiting on a
  remote model, and returns the seconds it actually waited as a measured score (no pass/fail).

Specs reference it as `{"kind": "registered", "id": "j1", "name": "sleep", "params": {"seconds": "2.0"}}`.
This module is a library for the judge service, not a benchmark: run as a script it does nothing.
"""

from __future__ import annotations

import asyncio
import time

from evalbus_contracts import RegisteredJudge, Score
from evalbus_judge.context import Judge, JudgeContext, measured
from evalbus_judge.registry import JudgeRegistry

SLEEP = "sleep"
"""Registry name of the sleeping judge."""


class SleepJudge:
    """Waits a fixed time per case; its score is the measured wait in seconds."""

    def __init__(self, spec: RegisteredJudge) -> None:
        """Read `params.seconds` (a number, ≥ 0); raises `ValueError` otherwise (the registry
        then scores every case `unmeasured: grader_error`)."""
        self.judge_id = spec.id
        self.seconds = float(spec.params.get("seconds", "1.0"))
        if not self.seconds >= 0.0:
            raise ValueError(f"seconds must be a number ≥ 0, not {spec.params.get('seconds')!r}")

    async def judge(self, ctx: JudgeContext) -> Score:
        """Sleep, then report how long the sleep really took."""
        started = time.monotonic()
        await asyncio.sleep(self.seconds)
        waited = time.monotonic() - started
        return measured(self.judge_id, round(waited, 6), passed=None, detail=f"slept {waited:.3f}s for {ctx.run_id}")


def sleep_judge(spec: RegisteredJudge) -> Judge:
    """Factory of the `sleep` judge."""
    return SleepJudge(spec)


def register(registry: JudgeRegistry) -> None:
    """Register the benchmark judges on the judge service's registry (the `JUDGE_PLUGINS` entry)."""
    registry.register(SLEEP, sleep_judge)
