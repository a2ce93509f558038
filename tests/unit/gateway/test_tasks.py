"""``gateway.tasks.running``: the task runs for the block, is cancelled and awaited on exit."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from gateway.tasks import running


async def _forever() -> None:
    await asyncio.Event().wait()


async def _fail() -> None:
    raise ValueError("task")


async def _block(
    coro: Coroutine[Any, Any, None], raises: BaseException | None, seen: list[asyncio.Task[None]]
) -> None:
    """Run ``coro`` for a block that lets it start (or end, if it fails), then raises ``raises``;
    the task goes to ``seen``."""
    async with running(coro, name="test") as task:
        seen.append(task)
        await asyncio.wait([task], timeout=0.01)
        if raises is not None:
            raise raises


async def test_the_task_runs_in_the_block_and_is_cancelled_on_exit() -> None:
    async with running(_forever(), name="test-forever") as task:
        await asyncio.sleep(0)
        assert task.get_name() == "test-forever"
        assert not task.done()
    assert task.cancelled()


async def test_an_exception_in_the_block_propagates_and_the_task_is_cancelled() -> None:
    seen: list[asyncio.Task[None]] = []
    with pytest.raises(LookupError, match="body"):
        await _block(_forever(), LookupError("body"), seen)
    assert seen[0].cancelled()


async def test_a_task_that_failed_raises_its_exception_on_exit() -> None:
    seen: list[asyncio.Task[None]] = []
    with pytest.raises(ValueError, match="task"):
        await _block(_fail(), None, seen)
    # Also when the block raised: the task's exception is raised, the block's is its context.
    with pytest.raises(ValueError, match="task") as caught:
        await _block(_fail(), LookupError("body"), seen)
    assert isinstance(caught.value.__context__, LookupError)
    assert all(task.done() and not task.cancelled() for task in seen)


async def test_a_task_that_returned_is_awaited_quietly() -> None:
    async def done() -> int:
        return 7

    async with running(done(), name="test-done") as task:
        await asyncio.wait([task])
    assert task.result() == 7
