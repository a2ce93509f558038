"""The public application's one middleware layer: request context, JSON errors, body timeout,
admin guard.

``gateway_middleware(store, admin_gate)`` is installed outermost on the public application (by
``gateway.app.build_app``), ahead of the tenants' middleware. It does in one coroutine per
request what four middlewares stacked would do; its contract is in its docstring.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway.config.store import SettingsStore
from gateway.http.admin import AdminGate
from gateway.http.error_middleware import response_for_exception
from gateway.http.request_body import read_body_in_time
from gateway.observability.logs import end_request, start_request


def gateway_middleware(store: SettingsStore, admin_gate: AdminGate) -> Middleware:
    """The public application's one middleware (outermost, before the tenants'): in one layer,
    what these would do stacked in this order (one coroutine per request instead of four):

    1. ``request_context_middleware``: request id, ``RequestOutcome``, the access line (status
       499 when cancelled);
    2. ``error_middleware``: every exception from what follows becomes its JSON error response
       (``response_for_exception``);
    3. ``body_read_timeout_middleware``: a body not yet whole is read within
       ``server.client_read_timeout_s`` (else 408);
    4. ``admin_middleware``: ``admin_gate`` on the admin paths (401 without the token, or 404
       when a separate admin listener serves them).
    """
    clock = time.monotonic

    @web.middleware
    async def impl(request: web.Request, handler: Handler) -> web.StreamResponse:
        outcome = start_request(request, clock())
        status = 500
        try:
            try:
                if not request.content.is_eof():
                    refused = await read_body_in_time(request, store)
                    if refused is not None:
                        status = refused.status
                        return refused
                admin_gate.check(request)
                response = await handler(request)
            except Exception as exc:
                converted = response_for_exception(request, exc)
                if converted is None:
                    raise
                response = converted
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:  # client gone (handler_cancellation) or shutdown
            status = 499
            raise
        finally:
            end_request(outcome, status, clock(), store)

    return impl
