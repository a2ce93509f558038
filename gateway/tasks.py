"""A background task for the life of a block: ``async with running(coro, name=...) as task:``.

The cleanup contexts (and other lifecycles) that keep a loop going while the app runs all want
the same thing: start the task on entry; on exit, whether the block ended or raised, cancel it
and wait until it is over. Its ``CancelledError`` is swallowed there; any other exception the
task ended with is raised from the exit, as awaiting the task would. This module imports only
the standard library, so any module of the gateway may use it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

__all__ = ["running"]

T = TypeVar("T")


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, T], *, name: str) -> AsyncIterator[asyncio.Task[T]]:
    """Run ``coro`` as a task named ``name`` while the block runs; yield the task.

    On exit (the block ended, raised or was cancelled) the task is cancelled and awaited, so
    nothing of it outlives the block. A ``CancelledError`` from awaiting it is suppressed and the
    block's own exception, if any, goes on. An exception the task had already ended with is
    raised from the exit instead (the block's exception, if any, as its ``__context__``).
    """
    task = asyncio.create_task(coro, name=name)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
