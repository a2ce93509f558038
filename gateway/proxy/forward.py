"""Forward a request to a replica: placement, the exchange in the handler's task, shutdown.

What it does:

* asks admission (``gateway.admission.live``) where the request goes: the replica with the
  most slack that meets its targets, after a wait in Sluice's queue if need be, or a typed
  refusal (``gateway.http.errors.Refused``: 429 / 503 / 400). It holds a lease on that replica until
  the response or stream has fully ended;
* has the answer relayed (``gateway.proxy.relay``): SSE events as they arrive, one write per
  event, never buffering the body; a streaming request always asks the replica for usage, and
  the extra usage chunk is removed again when the client did not ask for it;
* records prompt/completion tokens, TTFT, replica, status and the admission decision in the
  request's ``RequestOutcome`` and hands it to the outcome listeners when the request is over,
  requests refused before dispatch included;
* keeps the request in the replica's in-flight view (``LiveRequest``: prompt tokens, tokens
  streamed so far, one increment per content-carrying event) from dispatch until it is over, and,
  with ``predictions``, forecasts it on the chosen replica (``x-sluice-*`` response headers) and
  hands its usage to the prediction service at the end;
* notices a client that went away (``gateway.proxy.disconnects``) and then closes the upstream
  response (``close``, not ``release``) so the replica aborts the request and frees its KV cache.

The headers that cross each way are ``gateway.proxy.headers``'s job.

Failures: refused connection or a replica dying before the headers -> 502; after the headers of a
stream -> a final ``data: {"error": ...}`` event and the connection closes (never a fake
``[DONE]``). Replica 4xx answers pass through unchanged; replica 5xx answers become 502.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable
from typing import Final

import aiohttp
from aiohttp import web

from gateway.admission.live import LiveAdmission, Ticket, mark_saturated
from gateway.admission.retry_after import UNMEASURED_WAIT_S, RefusalReason, retry_after
from gateway.api.json_body import JsonLimits
from gateway.api.openai import Endpoint, encode_upstream_body, read_request, upstream_path, with_max_tokens
from gateway.api.sse import Event, EventSplitter
from gateway.config.store import SettingsStore
from gateway.http.echo import clip
from gateway.http.errors import GatewayError, Refused, UpstreamError
from gateway.keys import OutcomeListener
from gateway.observability.logs import OUTCOME
from gateway.observability.outcome import RequestOutcome
from gateway.observability.repeats import repeat_key
from gateway.prediction.live import (
    PREDICTED_TTFT_HEADER,
    PREDICTION_HEADERS,
    Admitted,
    LivePredictions,
    ttft_header_value,
)
from gateway.proxy.disconnects import DisconnectMonitor, connection_gone
from gateway.proxy.exchange import (
    CLIENT_CLOSED_REQUEST,
    Exchange,
    ReplicaOverloaded,
    describe,
    detached,
    nothing,
)
from gateway.proxy.headers import forwarded, relayed
from gateway.proxy.relay import OVERLOAD_STATUSES, Relay, is_overload_event
from gateway.replicas.registry import Replica, ReplicaRegistry

log = logging.getLogger("sluice.proxy")

#: Replicas one request may be placed on when they refuse it as overloaded (the first included).
MAX_PLACEMENTS = 3


class Proxy:
    """The request path from parsed body to relayed answer; one per application."""

    def __init__(
        self,
        *,
        store: SettingsStore,
        registry: ReplicaRegistry,
        session: aiohttp.ClientSession,
        disconnects: DisconnectMonitor,
        listeners: list[OutcomeListener] | None = None,
        on_replica_failure: Callable[[], None] | None = None,
        admission: LiveAdmission,
        predictions: LivePredictions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._registry = registry
        self._session = session
        self._disconnects = disconnects
        self.listeners: list[OutcomeListener] = listeners if listeners is not None else []
        self._predictions = predictions
        self._admission = admission
        self._clock = clock
        self._relay = Relay(registry, on_replica_failure, clock)
        #: Draining after SIGTERM: new requests are refused with 503 (requests in flight go on).
        self.draining = False
        #: Exchanges running now (the handler task running each -> the exchange), for ``stop_all``.
        self._active: dict[asyncio.Task[object], Exchange] = {}

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """Serve one ``/v1/chat/completions`` or ``/v1/completions`` request end to end.

        Raises ``GatewayError`` for anything answered before a response was started; the error
        middleware turns it into JSON. Errors after a stream started end that stream instead.
        """
        outcome = request[OUTCOME]
        settings = self._store.current
        ticket: Ticket | None = None
        try:
            if self.draining:
                raise _shutting_down("Sluice is shutting down; retry shortly")
            parsed = await read_request(
                request,
                endpoint,
                settings.server.max_body_bytes,
                JsonLimits(settings.server.max_json_depth, settings.server.max_json_items),
            )
            outcome.model, outcome.stream = clip(parsed.model), parsed.stream
        except GatewayError as err:
            self._refused(outcome, err)
            raise
        # A replica that answers its own overload refusal (TGI's 429 past its concurrency limit,
        # a 503) before any byte reached the client is left alone for a while and the request is
        # placed again: on another replica, or refused with Sluice's own 429 and Retry-After.
        for attempt in itertools.count():
            try:
                ticket = await self._admission.admit(request, parsed, outcome, watch=self._disconnects.watch)
                replica = ticket.replica
                admitted = self._with_overhead(request, replica, outcome, ticket)
            except GatewayError as err:
                # Refused before dispatch (unknown model, admission): still an outcome.
                self._refused(outcome, err)
                raise
            live = admitted.live
            # A max_tokens the gateway set (a response its tenant's budget must hold whole) is sent.
            sent = parsed if ticket.max_tokens_set is None else with_max_tokens(parsed, ticket.max_tokens_set)
            exchange = Exchange(request, sent, replica, settings, outcome, live)
            exchange.may_retry = attempt < MAX_PLACEMENTS - 1
            if parsed.stream:
                # A stream that outruns its tenant's reservation is charged ahead, or stopped.
                exchange.paid_output = self._admission.covered_output(ticket)
                exchange.charge_ahead = functools.partial(self._admission.charge_ahead, ticket)
                exchange.token_unit = self._admission.token_unit(ticket)
            try:
                with self._registry.lease(replica, live):
                    outcome.replica = replica.name
                    return await self._forward(exchange)
            except ReplicaOverloaded as over:
                self._admission.replica_refused(
                    ticket, over.back_off_s, over.why, placed_again=exchange.may_retry
                )
                if not exchange.may_retry:
                    # Out of placements: Sluice's own 429, never the replica's raw refusal.
                    exchange.overloaded = False
                    # Admitted, then refused by every replica it tried.
                    mark_saturated(request, outcome.request_class or "", settings.admission)
                    raise _saturated(
                        outcome, self._admission.saturated(parsed.model, over.back_off_s, placed=True)
                    ) from None
                if ticket is not None:
                    self._admission.finished(ticket, outcome)
                ticket = None
                outcome.replica = outcome.dispatched_at = None
                continue
            except GatewayError as err:
                outcome.status, outcome.error = err.status, err.code
                raise
            finally:
                if not exchange.overloaded:
                    if outcome.error is None and outcome.dispatched_at is not None:
                        self._registry.report_success(replica)
                    outcome.finished_at = self._clock()
                    outcome.tokens_streamed = live.tokens_streamed
                    if ticket is not None:
                        # Settles the budget and teaches the prediction service too, against
                        # the forecast with the dispatch overhead (what the TTFT measures).
                        self._admission.finished(ticket, outcome, forecast=admitted.forecast)
                    self._notify(outcome)
        raise AssertionError("unreachable")  # pragma: no cover

    def _refused(self, outcome: RequestOutcome, err: GatewayError) -> None:
        outcome.status, outcome.error = err.status, err.code
        outcome.finished_at = self._clock()
        self._notify(outcome)

    def _with_overhead(
        self, request: web.Request, replica: Replica, outcome: RequestOutcome, ticket: Ticket
    ) -> Admitted:
        """Admission's forecast with ``replica``'s learned dispatch overhead added to its TTFT
        (``PredictionService.with_overhead``: the HTTP hop and the replica server's own work, which
        the TTFT the gateway measures holds and the engine forecast does not), as the response's
        headers, the outcome and the prediction service (``finished``) see it."""
        forecast = ticket.forecast
        if self._predictions is None or forecast is None:
            return Admitted(ticket.live, forecast, ticket.headers)
        forecast = self._predictions.service.with_overhead(replica.name, forecast, self._clock())
        headers = ticket.headers
        if forecast.overhead_s > 0.0:
            outcome.predicted_ttft_s = forecast.ttft_s
            if PREDICTED_TTFT_HEADER in headers:  # exposed (``expose_prediction_headers``)
                # Only the TTFT moved (the overhead is added to finite TTFTs only): admission's
                # headers are kept, not built again.
                headers = {**headers, PREDICTED_TTFT_HEADER: ttft_header_value(forecast.ttft_s)}
                request[PREDICTION_HEADERS] = headers
        return Admitted(ticket.live, forecast, headers)

    def _notify(self, outcome: RequestOutcome) -> None:
        for listener in self.listeners:
            try:
                listener(outcome)
            except Exception:
                log.exception("outcome listener %r failed", listener)

    async def _forward(self, ex: Exchange) -> web.StreamResponse:
        """Run the exchange in the handler's own task, which the disconnect monitor (and
        ``stop_all``) cancel to end it.

        A vanished client ends it quietly: the upstream response is closed and the outcome says
        ``client_disconnected`` (status 499 when nothing had been sent yet).

        No task of its own (one task and a loop iteration less per request): the monitor cancels
        the handler, at most once per exchange (``Exchange.cancelled``), only while it awaits
        inside ``_exchange``, and that one cancellation is taken back (``Task.uncancel``) before
        the exchange is answered. A cancellation that is not Sluice's (aiohttp's, at shutdown or
        with ``handler_cancellation``) propagates as before.
        """
        handler = asyncio.current_task()
        assert handler is not None

        def end() -> None:
            if not ex.cancelled:
                ex.cancelled = True
                handler.cancel()

        unwatch = self._disconnects.watch(ex.request, end)
        ex.end = end
        self._active[handler] = ex
        try:
            response = await self._exchange(ex)
        except asyncio.CancelledError:
            if not ex.cancelled or handler.uncancel() > 0:
                # aiohttp cancelled the handler itself: a disconnect (with handler_cancellation)
                # or shutdown. The exchange's upstream response was closed on the way out.
                lost = connection_gone(ex.request)
                ex.outcome.error = "client_disconnected" if lost else "cancelled"
                raise
        else:
            if ex.cancelled:
                # Cancelled as it finished and the cancellation went unseen: take it back all the
                # same, and the exchange's own answer stands (as a finished task's would).
                handler.uncancel()
            return response
        finally:
            self._active.pop(handler, None)
            unwatch()
            # ``end`` closes over ``ex`` (and the handler task): left in place, the pair would be
            # a reference cycle holding the whole request (task, coroutine, aiohttp request,
            # outcome, reservation) until the cycle collector found it, instead of freeing it
            # when the handler returns.
            ex.end = nothing
        # Sluice's own cancellation, taken back: nothing can cancel it again from here on.
        if ex.stopping:
            return await self._stopped(ex)
        return self._client_gone(ex)

    def stop_all(self) -> int:
        """The shutdown grace is running out: end every exchange still running, now. A stream gets
        an error event (code ``server_shutting_down``) and ends; a request not yet answered gets a
        503 with Retry-After. Their handlers then return normally, so every outcome is reported
        and every reservation settled before the process exits. Returns how many were stopped."""
        stopped = 0
        for task, ex in list(self._active.items()):
            if not task.done() and not ex.cancelled:
                ex.stopping = True
                ex.end()
                stopped += 1
        return stopped

    async def _stopped(self, ex: Exchange) -> web.StreamResponse:
        """The answer to an exchange ``stop_all`` ended (its upstream response is closed)."""
        if ex.response is not None and ex.response.prepared:
            ex.outcome.status = ex.response.status
            await self._relay.end_with_error(ex, ex.response, _stopped_error(ex.outcome))
            return ex.response
        raise _stopped_error(ex.outcome)

    async def _exchange(self, ex: Exchange) -> web.StreamResponse:
        """Send the request and relay the answer; always closes the upstream response."""
        upstream: aiohttp.ClientResponse | None = None
        try:
            upstream = await self._send(ex)
            if upstream.status in OVERLOAD_STATUSES:
                raise await self._relay.overloaded(ex, upstream)
            if upstream.status >= 400:
                return await self._relay.relay_error(ex, upstream)
            if ex.parsed.stream:
                splitter = EventSplitter()
                first: list[Event] = []
                if ex.replica.engine == "tgi":
                    # TGI refuses a stream past its concurrency limit with a 200 whose only
                    # event is the overload error: look before the client is answered.
                    first = await self._relay.first_events(ex, upstream, splitter)
                    if first and is_overload_event(first[0]):
                        ex.overloaded = True
                        raise ReplicaOverloaded(UNMEASURED_WAIT_S, "refused a stream: Model is overloaded")
                ex.response = web.StreamResponse(status=upstream.status, headers=relayed(upstream.headers))
                return await self._relay.relay_stream(ex, upstream, ex.response, splitter, first)
            return await self._relay.relay_body(ex, upstream)
        except ConnectionResetError:  # writing to the client failed: it went away
            return self._client_gone(ex)
        finally:
            if upstream is not None:
                # close(), not release(): an unfinished body must drop the connection so the
                # replica sees the disconnect and aborts the request. After a complete body the
                # connection is already back in the pool and this does nothing.
                upstream.close()

    def _client_gone(self, ex: Exchange) -> web.StreamResponse:
        ex.outcome.error = "client_disconnected"
        log.info(
            "request %s: client disconnected; upstream request closed",
            ex.outcome.request_id,
            extra=repeat_key("client disconnected"),  # a burst of them is one line and a count
        )
        if ex.response is not None and ex.response.prepared:
            ex.outcome.status = ex.response.status
            return ex.response
        ex.outcome.status = CLIENT_CLOSED_REQUEST
        return web.Response(status=CLIENT_CLOSED_REQUEST)

    async def _send(self, ex: Exchange) -> aiohttp.ClientResponse:
        """POST to the replica and return once its headers arrived; connection failures -> 502."""
        server = ex.settings.server
        timeout = _upstream_timeout(server.upstream_connect_timeout_s, server.upstream_read_timeout_s)
        url = ex.replica.base_url + upstream_path(ex.parsed)
        body = await encode_upstream_body(ex.parsed)
        ex.outcome.dispatched_at = self._clock()
        try:
            return await self._session.post(
                url,
                data=body,
                headers=forwarded(ex.request, ex.replica.settings.authorization()),
                timeout=timeout,
                allow_redirects=False,
                # The replica's key is in the headers already: no session middleware on this path.
                middlewares=(),
            )
        except TimeoutError as exc:
            self._relay.replica_timed_out(ex.replica, exc)
            message = f"replica {ex.replica.name} timed out"
            raise UpstreamError(message, detail=describe(exc)) from detached(exc)
        except aiohttp.ClientError as exc:
            self._relay.replica_failed(ex.replica, exc)
            message = f"replica {ex.replica.name} is unreachable"
            raise UpstreamError(message, detail=describe(exc)) from detached(exc)


PROXY: Final = web.AppKey("proxy", Proxy)


# The errors below are built by a function and raised where they are made: an error kept in a
# local of the raising frame makes a reference cycle with its own traceback (error -> traceback ->
# frame -> error), and the whole request would then wait for the cycle collector instead of being
# freed when its handler returns (``tests/integration/gateway/test_no_request_cycles.py``).


def _saturated(outcome: RequestOutcome, err: Refused) -> Refused:
    """Every placement refused as overloaded: Sluice's 429 (``err``), recorded on ``outcome``."""
    outcome.status, outcome.error, outcome.retry_after_s = err.status, err.code, err.retry_after_s
    return err


def _shutting_down(message: str) -> Refused:
    """The 503 of a gateway that is stopping: retry, on another gateway replica, after a second."""
    reason = RefusalReason.SHUTTING_DOWN
    return Refused(reason, message, retry_after=retry_after(reason, UNMEASURED_WAIT_S))


def _stopped_error(outcome: RequestOutcome) -> Refused:
    """An exchange ``stop_all`` ended: its 503 (or a stream's error event), recorded on ``outcome``."""
    err = _shutting_down("Sluice is shutting down and ended this request; retry it")
    outcome.error = err.code
    return err


@functools.lru_cache(maxsize=16)
def _upstream_timeout(connect_s: float, read_s: float) -> aiohttp.ClientTimeout:
    """The upstream timeouts (seconds; no total: a stream may last long), one immutable object per
    setting instead of one per request."""
    return aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=read_s)
