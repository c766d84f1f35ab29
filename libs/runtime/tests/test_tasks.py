"""`cancel_and_wait`: a background task ends even when it loses a cancel, and the caller's own
cancellation is not swallowed."""

from __future__ import annotations

import asyncio

import pytest

from evalbus_runtime.tasks import awaiting_at, cancel_and_wait

pytestmark = pytest.mark.unit


def losing(cancels_lost: int) -> tuple[asyncio.Task[None], list[int]]:
    """A loop that carries on after its first `cancels_lost` cancels, as one whose `wait_for` (on
    Python 3.11) completed in the same turn as the cancel does; -1: after every cancel. The list
    counts the cancels lost and, in its second item, the limit (which the test may change)."""
    lost = [0, cancels_lost]

    async def loop() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if lost[1] < 0 or lost[0] < lost[1]:
                    lost[0] += 1
                    continue
                raise

    return asyncio.create_task(loop()), lost


async def test_a_task_that_lost_its_first_cancels_is_cancelled_again_until_it_ends() -> None:
    task, lost = losing(3)
    await asyncio.sleep(0)
    async with asyncio.timeout(10):
        assert await cancel_and_wait(task)
    assert task.cancelled()
    assert lost[0] == 3


async def test_the_callers_timeout_is_not_swallowed() -> None:
    task, lost = losing(-1)
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await cancel_and_wait(task)
    assert not task.done()
    assert lost[0] >= 2
    assert "in loop" in awaiting_at(task)
    assert not await cancel_and_wait(task, grace_s=0.2)  # it never ends: given up on, not waited for
    lost[1] = 0  # now it takes a cancel
    assert await cancel_and_wait(task)


async def test_an_exception_the_task_ended_with_is_raised() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="boom"):
        await cancel_and_wait(task)


async def test_a_finished_task_is_left_as_it_is() -> None:
    task = asyncio.create_task(asyncio.sleep(0))
    await task
    assert await cancel_and_wait(task)
