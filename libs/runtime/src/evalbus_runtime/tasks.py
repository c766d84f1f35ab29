"""Ending background tasks reliably.

`task.cancel()` followed by `await task` under `suppress(CancelledError)` has two faults on Python
3.11: an `asyncio.wait_for` whose inner future completes in the same turn as the cancel returns the
result instead of raising (nats-py's requests are `wait_for`s), so a loop cancelled once at that
moment carries on — and waits for ever to be awaited; and the `suppress` also swallows a
cancellation of the *caller*, so an `asyncio.timeout` around the stop never fires.
`cancel_and_wait` repeats the cancel until the task has ended and lets the caller's cancellation
through.
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_S = 0.05
"""How long a cancelled task may run on before it is cancelled again."""


async def cancel_and_wait(task: asyncio.Task[Any], *, grace_s: float | None = None) -> bool:
    """Cancel `task` until it has ended; True when it ended (within `grace_s`, when given).

    For tasks that hold no cleanup of their own on cancellation (a repeated cancel interrupts an
    `except CancelledError` or `finally` that awaits). An exception the task ended with is raised
    here, as `await task` would."""
    loop = asyncio.get_running_loop()
    deadline = None if grace_s is None else loop.time() + grace_s
    while not task.done():
        wait_s = RECANCEL_S
        if deadline is not None:
            left = deadline - loop.time()
            if left <= 0:
                return False
            wait_s = min(wait_s, left)
        task.cancel()
        await asyncio.wait({task}, timeout=wait_s)
    if not task.cancelled():
        task.result()
    return True


def awaiting_at(task: asyncio.Task[Any]) -> str:
    """Where a suspended task waits: its chain of awaits, outermost first, one frame per line
    (`Task.get_stack` gives only the outermost frame of a suspended coroutine)."""
    lines: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None and len(lines) < 64:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return "\n".join(lines) or "  (no frames)"
