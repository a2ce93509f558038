"""The ``Server`` header every response carries: ``server.server_header`` (default ``sluice``).

aiohttp writes ``Server: Python/3.x aiohttp/3.x`` on every response that has none, which tells
anyone which versions (and so which known bugs) to try. ``server_header_hook(store)`` is an
``on_response_prepare`` signal handler that sets the configured name first, read per response
(a reload applies at once); ``gateway.http.parse_errors`` sets it on the answers aiohttp's parser
gives before any application runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from gateway.config.store import SettingsStore

__all__ = ["server_header_hook"]


def server_header_hook(
    store: SettingsStore,
) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """An ``on_response_prepare`` handler: ``Server`` is ``store.current.server.server_header``."""

    async def hook(_request: web.Request, response: web.StreamResponse) -> None:
        response.headers[hdrs.SERVER] = store.current.server.server_header

    return hook
