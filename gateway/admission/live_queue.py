"""The live adapter's queue: the handlers of queued requests and the event loop's timer.

A request the engine queues is a handler awaiting a future (``LiveQueue.wait``); the engine's
``Resolution``s complete them (``apply``: a dispatch whose handler is gone is forgotten again),
and the loop's timer is armed for ``AdmissionEngine.next_wakeup`` (``schedule``), where the
adapter re-evaluates the queue. A client that goes away while its request is queued is dropped
from the queue (its budget refunded by the engine) and answered ``ClientClosedRequest``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from gateway.admission.engine import AdmissionEngine
from gateway.admission.results import Resolution
from gateway.http.errors import ClientClosedRequest
from gateway.observability.outcome import RequestOutcome

__all__ = ["CallLater", "LiveQueue", "TimerHandle", "Watch"]

log = logging.getLogger("sluice.admission")


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


#: Arms a timer: (delay in seconds, callback) -> its handle (default: the running loop's ``call_later``).
CallLater = Callable[[float, Callable[[], None]], TimerHandle]
#: The disconnect monitor's ``watch(request, on_lost)``: returns the call that stops watching.
Watch = Callable[[web.BaseRequest, Callable[[], object]], Callable[[], None]]


class LiveQueue:
    """Queued handlers and the timer over ``engine`` (see the module; event loop only).

    ``clock``: the adapter's monotonic seconds. ``call_later``: arms the timer (``None``: the
    running loop's). ``reevaluate``: what the timer runs (the adapter's re-evaluation, which
    ``apply``s what the engine decided)."""

    def __init__(
        self,
        engine: AdmissionEngine,
        clock: Callable[[], float],
        call_later: CallLater | None,
        reevaluate: Callable[[], None],
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._call_later = call_later
        self._reevaluate = reevaluate
        #: Queued handlers by the engine's key.
        self._waiting: dict[int, asyncio.Future[Resolution]] = {}
        self._timer: TimerHandle | None = None
        self._timer_at = math.inf
        self.closed = False

    def close(self) -> None:
        """Stop the timer and cancel every queued request's handler (the app is stopping)."""
        self.closed = True
        self._cancel_timer()
        for future in self._waiting.values():
            if not future.done():
                future.cancel()
        self._waiting.clear()

    async def wait(
        self, request: web.Request, outcome: RequestOutcome, key: int, arrival_s: float, watch: Watch | None
    ) -> Resolution:
        """Wait in the queue until a re-evaluation decides request ``key``; the client going away
        (``watch``) cancels it: then the outcome says so and ``ClientClosedRequest`` is raised."""
        future: asyncio.Future[Resolution] = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        unwatch = watch(request, lambda: self._client_gone(key)) if watch is not None else None
        self.schedule()
        try:
            return await future
        except asyncio.CancelledError:
            self._waiting.pop(key, None)
            # Still queued: counted as cancelled. Dispatched, but its handler was cancelled
            # before it ran: forgotten on its replica.
            self._engine.drop(key, self._clock())
            self.schedule()
            if future.cancelled() and _gone(request):
                outcome.decision, outcome.reason = "cancelled", "client_disconnected"
                outcome.queue_wait_s = max(0.0, self._clock() - arrival_s)
                raise ClientClosedRequest("the client went away while its request was queued") from None
            raise
        finally:
            if unwatch is not None:
                unwatch()

    def _client_gone(self, key: int) -> None:
        future = self._waiting.pop(key, None)
        if future is not None and not future.done():
            self._engine.drop(key, self._clock())
            self.schedule()
            future.cancel()

    def apply(self, resolutions: list[Resolution]) -> None:
        """Complete the handlers the engine decided; a dispatch whose handler is gone is
        forgotten again. Then re-arm the timer."""
        for resolution in resolutions:
            future = self._waiting.pop(resolution.key, None)
            if future is None or future.done():
                self._engine.drop(resolution.key, self._clock())
            else:
                future.set_result(resolution)
        self.schedule()

    def schedule(self) -> None:
        """Arm the timer for the engine's next wake-up (none when nothing waits)."""
        if self.closed:
            return
        now = self._clock()
        when = self._engine.next_wakeup(now)
        if when is None:
            self._cancel_timer()
            return
        if self._timer is not None and self._timer_at <= when:
            return
        self._cancel_timer()
        self._timer_at = when
        call_later = self._call_later or asyncio.get_running_loop().call_later
        self._timer = call_later(max(0.0, when - now), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        try:
            self._reevaluate()
        except Exception:
            log.exception("queue re-evaluation failed")
            self.schedule()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_at = math.inf


def _gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
