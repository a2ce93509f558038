"""Noticing a client that went away: one poller per application, for every request watched.

``DisconnectMonitor.watch(request, on_lost)`` calls ``on_lost()`` once, within ``interval_s``
seconds, after ``request``'s connection closes; the proxy then ends the exchange and closes the
upstream response so the replica aborts the request. ``DISCONNECTS`` is its app key.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Final

from aiohttp import web

log = logging.getLogger("sluice.proxy")


class DisconnectMonitor:
    """Tells handlers when their client connection is gone, within ``interval_s`` seconds.

    aiohttp 3.x does not cancel a handler when its client disconnects (``handler_cancellation``
    is off by default) and offers nothing to await, so one task per application polls every
    watched request's transport; a single poller keeps the cost flat in the number of requests.
    """

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self._watched: dict[int, tuple[web.BaseRequest, Callable[[], object]]] = {}
        self._ids = itertools.count()

    def watch(self, request: web.BaseRequest, on_lost: Callable[[], object]) -> Callable[[], None]:
        """Call ``on_lost()`` once if ``request``'s connection closes (its result is ignored);
        returns the function that stops watching."""
        key = next(self._ids)
        self._watched[key] = (request, on_lost)

        def unwatch() -> None:
            self._watched.pop(key, None)

        return unwatch

    def sweep(self) -> int:
        """Fire the callbacks of requests whose connection is gone; returns how many fired."""
        gone = [key for key, (request, _) in self._watched.items() if connection_gone(request)]
        for key in gone:
            entry = self._watched.pop(key, None)
            if entry is not None:
                try:
                    entry[1]()
                except Exception:
                    log.exception("disconnect callback failed")
        return len(gone)

    async def run(self) -> None:
        """Sweep every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.sweep()


def connection_gone(request: web.BaseRequest) -> bool:
    """True when ``request``'s connection is closed or closing (its client is gone)."""
    transport = request.transport
    return transport is None or transport.is_closing()


DISCONNECTS: Final = web.AppKey("disconnects", DisconnectMonitor)
