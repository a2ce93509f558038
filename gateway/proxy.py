"""Forward an OpenAI request to a replica and relay its answer, streaming or not.

What it does:

* asks admission (``gateway.admission.live``) where the request goes: the replica with the
  most slack that meets its targets, after a wait in Sluice's queue if need be, or a typed
  refusal (``gateway.http.errors.Refused``: 429 / 503 / 400). It holds a lease on that replica until
  the response or stream has fully ended;
* streams SSE events to the client as they arrive, one write per event, never buffering the body;
  a streaming request always asks the replica for usage, and the extra usage chunk is removed
  again when the client did not ask for it;
* records prompt/completion tokens, TTFT, replica, status and the admission decision in the
  request's ``RequestOutcome`` and hands it to the outcome listeners when the request is over,
  requests refused before dispatch included;
* keeps the request in the replica's in-flight view (``LiveRequest``: prompt tokens, tokens
  streamed so far, one increment per content-carrying event) from dispatch until it is over, and,
  with ``predictions``, forecasts it on the chosen replica (``x-sluice-*`` response headers) and
  hands its usage to the prediction service at the end;
* notices a client that went away (``DisconnectMonitor``) and then closes the upstream response
  (``close``, not ``release``) so the replica aborts the request and frees its KV cache.

Failures: refused connection or a replica dying before the headers -> 502; after the headers of a
stream -> a final ``data: {"error": ...}`` event and the connection closes (never a fake
``[DONE]``). Replica 4xx answers pass through unchanged; replica 5xx answers become 502.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.admission.live import LiveAdmission, Ticket, mark_saturated
from gateway.admission.retry_after import UNMEASURED_WAIT_S, RefusalReason, retry_after
from gateway.api.openai import (
    Endpoint,
    ParsedRequest,
    carries_tokens,
    is_usage_only_chunk,
    read_request,
    upstream_body,
    upstream_path,
    usage_of,
)
from gateway.api.sse import DONE, Event, EventSplitter
from gateway.api.tgi import (
    error_event,
    generated_tokens,
    input_tokens,
    is_final_event,
    is_token_event,
    without_details,
)
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.forecasts import (
    PREDICTED_TTFT_HEADER,
    PREDICTION_HEADERS,
    Admitted,
    LivePredictions,
    ttft_header_value,
)
from gateway.http.errors import (
    GatewayError,
    Refused,
    UpstreamError,
    log_error,
    sse_error_event,
)
from gateway.keys import OutcomeListener
from gateway.observability.logs import OUTCOME, REQUEST_ID, REQUEST_ID_HEADER, RequestOutcome
from gateway.replicas.registry import LiveRequest, Replica, ReplicaRegistry
from gateway.tenants.live import TENANT

__all__ = ["DISCONNECTS", "PROXY", "DisconnectMonitor", "Proxy", "RequestOutcome"]

log = logging.getLogger("sluice.proxy")

#: RFC 9110 section 7.6.1 hop-by-hop headers, never forwarded in either direction.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
#: Client headers not forwarded upstream: recomputed by aiohttp or set by Sluice itself. The
#: body Sluice sends is its own, uncompressed (aiohttp's server inflates a gzip or deflate body on
#: reading), so the client's ``Content-Encoding`` does not describe it; and it is sent whole, so
#: an ``Expect: 100-continue`` (curl's, for bodies over 1 KiB) was answered here and is not passed
#: on (as Envoy does).
_NOT_FORWARDED_UP = HOP_BY_HOP | {
    "host",
    "content-length",
    "content-type",
    "content-encoding",
    "expect",
    "accept-encoding",
    "x-forwarded-for",  # sent again with the client's address appended (``_forwarded``)
    REQUEST_ID_HEADER,
}
#: The header a tenant's API key came in (never forwarded once the tenancy middleware used it).
_TENANT_KEY = frozenset({"authorization"})
#: Replica headers not relayed to the client: recomputed by aiohttp or set by Sluice itself.
_NOT_RELAYED_DOWN = HOP_BY_HOP | {
    "content-length",
    "content-encoding",
    "date",
    "server",
    REQUEST_ID_HEADER,
}
#: Status logged for a request whose client went away before its response was sent (nginx's).
CLIENT_CLOSED_REQUEST = 499
#: Largest replica error body read when passing a 4xx through or reporting a 5xx, in bytes.
_MAX_ERROR_BODY = 1024 * 1024
#: Replicas one request may be placed on when they refuse it as overloaded (the first included).
MAX_PLACEMENTS = 3
#: Replica statuses that mean "overloaded, try elsewhere" (TGI: 429 past max_concurrent_requests).
_OVERLOAD_STATUSES = frozenset({429, 503})


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
        gone = [key for key, (request, _) in self._watched.items() if _connection_gone(request)]
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


def _connection_gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _nothing() -> None:
    """The default of ``_Exchange.end`` (an exchange not running yet has nothing to end)."""


@dataclass(slots=True)
class _Exchange:
    """One request's trip to one replica."""

    request: web.Request
    parsed: ParsedRequest
    replica: Replica
    settings: Settings
    outcome: RequestOutcome
    #: Its entry in the replica's in-flight view; the relay counts streamed tokens on it.
    live: LiveRequest
    #: The client's stream response, once one was created.
    response: web.StreamResponse | None = None
    #: A native TGI stream delivered its final event (or an error event, after which TGI stops).
    stream_done: bool = False
    #: The request may still be placed on another replica if this one refuses it as overloaded.
    may_retry: bool = False
    #: This replica refused it as overloaded before any byte reached the client.
    overloaded: bool = False
    #: The gateway is stopping and ended it (``Proxy.stop_all``).
    stopping: bool = False
    #: Sluice itself cancelled the handler to end this exchange (a lost client or ``stop_all``):
    #: at most once per exchange, so the cancellation it must take back is exactly one.
    cancelled: bool = False
    #: Ends the exchange (cancels its handler once); set by ``_forward``.
    end: Callable[[], None] = _nothing


class _ReplicaOverloaded(Exception):
    """A replica refused the request as overloaded before the client saw anything: place it again.

    ``back_off_s``: how long to leave the replica alone (its Retry-After, else
    ``UNMEASURED_WAIT_S``); Sluice's own refusal, when no placement is left, is computed from it.
    """

    def __init__(self, back_off_s: float, why: str) -> None:
        super().__init__(why)
        self.back_off_s = back_off_s
        self.why = why


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
        self._on_replica_failure = on_replica_failure
        self._predictions = predictions
        self._admission = admission
        self._clock = clock
        #: Draining after SIGTERM: new requests are refused with 503 (requests in flight go on).
        self.draining = False
        #: Exchanges running now (the handler task running each -> the exchange), for ``stop_all``.
        self._active: dict[asyncio.Task[object], _Exchange] = {}

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
            parsed = await read_request(request, endpoint, settings.server.max_body_bytes)
            outcome.model, outcome.stream = parsed.model, parsed.stream
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
            exchange = _Exchange(request, parsed, replica, settings, outcome, live)
            exchange.may_retry = attempt < MAX_PLACEMENTS - 1
            try:
                with self._registry.lease(replica, live):
                    outcome.replica = replica.name
                    return await self._forward(exchange)
            except _ReplicaOverloaded as over:
                self._admission.replica_refused(ticket, over.back_off_s, over.why)
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
                        self._admission.finished(ticket, outcome)
                    if self._predictions is not None:
                        self._predictions.finished(parsed, outcome, admitted)
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

    async def _forward(self, ex: _Exchange) -> web.StreamResponse:
        """Run the exchange in the handler's own task, which the disconnect monitor (and
        ``stop_all``) cancel to end it.

        A vanished client ends it quietly: the upstream response is closed and the outcome says
        ``client_disconnected`` (status 499 when nothing had been sent yet).

        No task of its own (one task and a loop iteration less per request): the monitor cancels
        the handler, at most once per exchange (``_Exchange.cancelled``), only while it awaits
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
                lost = _connection_gone(ex.request)
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
            ex.end = _nothing
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

    async def _stopped(self, ex: _Exchange) -> web.StreamResponse:
        """The answer to an exchange ``stop_all`` ended (its upstream response is closed)."""
        if ex.response is not None and ex.response.prepared:
            ex.outcome.status = ex.response.status
            await self._end_with_error(ex, ex.response, _stopped_error(ex.outcome))
            return ex.response
        raise _stopped_error(ex.outcome)

    async def _exchange(self, ex: _Exchange) -> web.StreamResponse:
        """Send the request and relay the answer; always closes the upstream response."""
        upstream: aiohttp.ClientResponse | None = None
        try:
            upstream = await self._send(ex)
            if upstream.status in _OVERLOAD_STATUSES:
                raise await self._overloaded(ex, upstream)
            if upstream.status >= 400:
                return await self._relay_error(ex, upstream)
            if ex.parsed.stream:
                splitter = EventSplitter()
                first: list[Event] = []
                if ex.replica.engine == "tgi":
                    # TGI refuses a stream past its concurrency limit with a 200 whose only
                    # event is the overload error: look before the client is answered.
                    first = await self._first_events(ex, upstream, splitter)
                    if first and _is_overload_event(first[0]):
                        ex.overloaded = True
                        raise _ReplicaOverloaded(UNMEASURED_WAIT_S, "refused a stream: Model is overloaded")
                ex.response = web.StreamResponse(status=upstream.status, headers=_relayed(upstream.headers))
                return await self._relay_stream(ex, upstream, ex.response, splitter, first)
            return await self._relay_body(ex, upstream)
        except ConnectionResetError:  # writing to the client failed: it went away
            return self._client_gone(ex)
        finally:
            if upstream is not None:
                # close(), not release(): an unfinished body must drop the connection so the
                # replica sees the disconnect and aborts the request. After a complete body the
                # connection is already back in the pool and this does nothing.
                upstream.close()

    def _client_gone(self, ex: _Exchange) -> web.StreamResponse:
        ex.outcome.error = "client_disconnected"
        log.info("request %s: client disconnected; upstream request closed", ex.outcome.request_id)
        if ex.response is not None and ex.response.prepared:
            ex.outcome.status = ex.response.status
            return ex.response
        ex.outcome.status = CLIENT_CLOSED_REQUEST
        return web.Response(status=CLIENT_CLOSED_REQUEST)

    async def _send(self, ex: _Exchange) -> aiohttp.ClientResponse:
        """POST to the replica and return once its headers arrived; connection failures -> 502."""
        server = ex.settings.server
        timeout = _upstream_timeout(server.upstream_connect_timeout_s, server.upstream_read_timeout_s)
        url = ex.replica.base_url + upstream_path(ex.parsed)
        ex.outcome.dispatched_at = self._clock()
        try:
            return await self._session.post(
                url,
                data=upstream_body(ex.parsed),
                headers=_forwarded(ex.request, ex.replica.settings.authorization()),
                timeout=timeout,
                allow_redirects=False,
                # The replica's key is in the headers already: no session middleware on this path.
                middlewares=(),
            )
        except TimeoutError as exc:
            self._replica_timed_out(ex.replica, exc)
            message = f"replica {ex.replica.name} timed out: {_describe(exc)}"
            raise UpstreamError(message) from _detached(exc)
        except aiohttp.ClientError as exc:
            self._replica_failed(ex.replica, exc)
            message = f"replica {ex.replica.name} is unreachable: {_describe(exc)}"
            raise UpstreamError(message) from _detached(exc)

    def _replica_failed(self, replica: Replica, exc: BaseException) -> None:
        """A connection-level failure counts as a failed health check and triggers a recheck."""
        self._registry.report_failure(replica, f"proxy: {_describe(exc)}")
        if self._on_replica_failure is not None:
            self._on_replica_failure()

    def _replica_timed_out(self, replica: Replica, exc: BaseException) -> None:
        """A read or connect timeout: counted towards ejecting the replica (its /health may still
        answer while its generation is stuck, so a health recheck would prove nothing)."""
        self._registry.report_timeout(replica, f"proxy: {_describe(exc)}")

    async def _read_upstream(
        self, ex: _Exchange, upstream: aiohttp.ClientResponse, limit: int | None = None
    ) -> bytes:
        """The rest of the replica's body (at most ``limit`` bytes when given).

        A broken connection or a read timeout raises ``UpstreamError``.
        """
        try:
            if limit is None:
                return await upstream.content.read()
            body = bytearray()
            while len(body) < limit and (chunk := await upstream.content.read(limit - len(body))):
                body += chunk
            return bytes(body)
        except TimeoutError as exc:
            self._replica_timed_out(ex.replica, exc)
            message = f"replica {ex.replica.name} timed out: {_describe(exc)}"
            raise UpstreamError(message) from _detached(exc)
        except aiohttp.ClientError as exc:
            self._replica_failed(ex.replica, exc)
            message = f"replica {ex.replica.name} failed mid-response: {_describe(exc)}"
            raise UpstreamError(message) from _detached(exc)

    async def _overloaded(self, ex: _Exchange, upstream: aiohttp.ClientResponse) -> _ReplicaOverloaded:
        """The replica's own overload refusal, read and turned into a signal to place again."""
        body = await self._read_upstream(ex, upstream, _MAX_ERROR_BODY)
        ex.overloaded = True
        back_off = _retry_after_s(upstream.headers.get("Retry-After")) or UNMEASURED_WAIT_S
        detail = _error_message(body) or upstream.reason or ""
        return _ReplicaOverloaded(back_off, f"answered {upstream.status}: {detail}".strip())

    async def _relay_error(self, ex: _Exchange, upstream: aiohttp.ClientResponse) -> web.Response:
        """Replica 4xx: relayed unchanged (status and body). Replica 5xx: 502 naming the replica."""
        body = await self._read_upstream(ex, upstream, _MAX_ERROR_BODY)
        if upstream.status >= 500:
            detail = _error_message(body) or upstream.reason or ""
            raise UpstreamError(f"replica {ex.replica.name} answered {upstream.status}: {detail}".strip())
        ex.outcome.status, ex.outcome.error = upstream.status, "replica_rejected"
        log.info(
            "request %s: replica %s answered %d: %s",
            ex.outcome.request_id,
            ex.replica.name,
            upstream.status,
            _error_message(body) or "-",
        )
        return web.Response(status=upstream.status, body=body, headers=_relayed(upstream.headers))

    async def _relay_body(self, ex: _Exchange, upstream: aiohttp.ClientResponse) -> web.Response:
        """A non-streaming answer: read it whole (it is one JSON object), take usage, relay it."""
        body = await self._read_upstream(ex, upstream)
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            # A 2xx that is not one JSON object is a broken replica, not an answer: 502, and the
            # request is settled as unanswered rather than charged a prediction.
            raise UpstreamError(f"replica {ex.replica.name} answered {upstream.status} without a JSON object")
        ex.outcome.status = upstream.status
        if ex.parsed.native:
            _record_native_usage(ex.outcome, payload, ex.live)
        else:
            _record_usage(ex.outcome, payload, ex.live)
        if ex.parsed.native and not ex.parsed.details:
            body = without_details(body)  # Sluice asked for them; the client did not
        # Answered here, before the request's bookkeeping (admission's and the predictor's
        # finish, the outcome listeners, the settle, the access line), not after it by aiohttp:
        # that work is then off the client's path, as a stream's is. The response hooks (request
        # id, prediction and rate-limit headers) run in ``prepare`` as before; a client gone by
        # now ends the exchange as a disconnect (``_exchange``).
        response = ex.response = web.Response(
            status=upstream.status, body=body, headers=_relayed(upstream.headers)
        )
        await response.prepare(ex.request)
        await response.write_eof()
        return response

    async def _first_events(
        self, ex: _Exchange, upstream: aiohttp.ClientResponse, splitter: EventSplitter
    ) -> list[Event]:
        """Read until the stream's first event with data is complete (or the stream ends); returns
        the events read so far, for ``_relay_stream`` to relay first."""
        events: list[Event] = []
        while not any(e.data is not None for e in events):
            chunk = await self._next_chunk(ex, upstream)
            if not chunk:
                break
            events += splitter.feed(chunk)
        return events

    async def _relay_stream(
        self,
        ex: _Exchange,
        upstream: aiohttp.ClientResponse,
        response: web.StreamResponse,
        splitter: EventSplitter,
        first: list[Event],
    ) -> web.StreamResponse:
        """Relay SSE events one by one (``first``: events already read from ``splitter``'s
        stream); a cut stream ends with an error event, then the connection."""
        await response.prepare(ex.request)
        ex.outcome.status = response.status
        native = ex.parsed.native
        inspect = self._inspect_native if native else self._inspect
        done = False
        try:
            events = first
            while True:
                for event in events:
                    if native:
                        relay = inspect(ex, event)
                        done = ex.stream_done
                    else:
                        done = done or event.data == DONE
                        relay = inspect(ex, event)
                    if relay:
                        await _write(ex, response, event.raw)
                chunk = await self._next_chunk(ex, upstream)
                if not chunk:
                    break
                events = splitter.feed(chunk)
            if not done:
                last = "its final event" if native else "[DONE]"
                raise UpstreamError(f"replica {ex.replica.name} ended the stream before {last}")
        except UpstreamError as err:
            await self._end_with_error(ex, response, err)
        return response

    async def _next_chunk(self, ex: _Exchange, upstream: aiohttp.ClientResponse) -> bytes:
        """The next bytes of the stream as they arrive (``b""`` at its end)."""
        try:
            return await upstream.content.readany()
        except TimeoutError as exc:
            self._replica_timed_out(ex.replica, exc)
            message = f"replica {ex.replica.name} timed out mid-stream: {_describe(exc)}"
            raise UpstreamError(message) from _detached(exc)
        except aiohttp.ClientError as exc:
            self._replica_failed(ex.replica, exc)
            message = f"replica {ex.replica.name} failed mid-stream: {_describe(exc)}"
            raise UpstreamError(message) from _detached(exc)

    def _inspect(self, ex: _Exchange, event: Event) -> bool:
        """Record what ``event`` tells (first token, tokens streamed, usage); return whether to
        relay it.

        The hot path: after the first token, an event without usage is one more streamed token
        (vLLM sends one chunk per engine step per sequence) and is not parsed. Its arrival time
        tells the forecast where the replica's step cycle is (tokens land at step ends).
        """
        data = event.data
        if data is None or data == DONE:
            return True
        outcome = ex.outcome
        if outcome.first_token_at is not None and '"usage"' not in data:
            live = ex.live
            live.tokens_streamed += 1
            live.last_token_at = self._clock()
            return True
        # Parse only what can matter: chunks before the first token, and chunks with usage.
        try:
            payload = json.loads(data)
        except ValueError:
            return True
        if carries_tokens(payload):
            now = self._clock()
            ex.live.tokens_streamed += 1
            ex.live.last_token_at = now
            if ex.live.first_token_at is None:
                ex.live.first_token_at = now
            if outcome.first_token_at is None:
                outcome.first_token_at = now
        _record_usage(outcome, payload, ex.live)
        return ex.parsed.include_usage or not is_usage_only_chunk(payload)

    def _inspect_native(self, ex: _Exchange, event: Event) -> bool:
        """``_inspect`` for a TGI ``/generate_stream``: one event per generated token, the last
        one with ``generated_text`` (and ``details`` when the client asked). Always relayed.

        The hot path: a token event after the first (``"generated_text":null``, as TGI's serde
        writes it) is counted without parsing.
        """
        data = event.data
        if data is None:
            return True
        live = ex.live
        if ex.outcome.first_token_at is not None and '"generated_text":null' in data:
            live.tokens_streamed += 1
            live.last_token_at = self._clock()
            return True
        try:
            payload = json.loads(data)
        except ValueError:
            return True
        if is_token_event(payload):
            now = self._clock()
            live.tokens_streamed += 1
            live.last_token_at = now
            if live.first_token_at is None:
                live.first_token_at = now
            if ex.outcome.first_token_at is None:
                ex.outcome.first_token_at = now
        if is_final_event(payload):
            ex.stream_done = True
            _record_native_usage(ex.outcome, payload, live)
            if ex.outcome.completion_tokens is None:
                ex.outcome.completion_tokens = live.tokens_streamed
        elif isinstance(payload, dict) and "error" in payload:
            ex.outcome.error = "upstream_error"
            ex.stream_done = True  # TGI ends the stream after an error event
        return True

    async def _end_with_error(self, ex: _Exchange, response: web.StreamResponse, err: GatewayError) -> None:
        ex.outcome.error = err.code
        log_error(err, ex.request.get(REQUEST_ID))
        response.force_close()
        event = (
            error_event(err.message, err.code or err.error_type) if ex.parsed.native else sse_error_event(err)
        )
        with contextlib.suppress(ConnectionResetError):
            await _write(ex, response, event)


DISCONNECTS = web.AppKey("disconnects", DisconnectMonitor)
PROXY = web.AppKey("proxy", Proxy)


def _detached(exc: BaseException) -> BaseException:
    """``exc`` without its traceback, to chain as a cause. aiohttp keeps the exception it raised
    on the response's payload stream (``StreamReader.set_exception``), and the traceback it then
    gathers holds the reader's frames here, whose locals hold the response and the exchange: a
    reference cycle that left every object of a failed stream to the cycle collector
    (``tests/integration/gateway/test_no_request_cycles.py``). The message is what the error
    reports (``_describe``); the frames were aiohttp's and this module's own."""
    return exc.with_traceback(None)


#: Bytes HTTP/1.1 chunked encoding adds to one write, at most (size line and CRLFs).
_CHUNK_FRAMING = 32


async def _write(ex: _Exchange, response: web.StreamResponse, data: bytes) -> None:
    """``response.write(data)``, which waits while the client's connection is backed up, for at
    most ``server.client_write_timeout_s``; past it the connection is aborted and
    ``ConnectionResetError`` raised (the exchange ends as a client disconnect).

    The hot path: while the transport's buffer stays under its high-water mark after this write,
    the write cannot wait (aiohttp drains only a paused transport), so no timer is armed (one
    costs about 5 us per event)."""
    transport = ex.request.transport
    if (
        transport is not None
        and not ex.request.protocol.writing_paused
        and transport.get_write_buffer_size() + len(data) + _CHUNK_FRAMING
        <= transport.get_write_buffer_limits()[1]
    ):
        await response.write(data)
        return
    try:
        async with asyncio.timeout(ex.settings.server.client_write_timeout_s):
            await response.write(data)
    except TimeoutError:
        if ex.request.transport is not None:
            ex.request.transport.abort()
        raise ConnectionResetError("the client took no data for server.client_write_timeout_s") from None


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


def _forwarded(request: web.Request, authorization: str | None = None) -> CIMultiDict[str]:
    """Headers for the replica: the client's minus hop-by-hop ones, plus ours.

    A tenant's API key authenticates it to Sluice, never to the replicas: once the tenancy
    middleware has authenticated a tenant, the client's ``Authorization`` stays here.
    ``authorization``: the replica's own key (``replicas[].api_key_env``), which replaces the
    client's ``Authorization`` whatever it was.

    As nginx's ``$proxy_add_x_forwarded_for`` and Envoy do, the client's address is appended to
    ``X-Forwarded-For`` (after the chain the client sent, its headers joined in order), so a
    replica's logs (vLLM behind ``--forwarded-allow-ips``) name the client, not Sluice; and
    ``X-Forwarded-Proto`` says the client's scheme unless a proxy in front already said it.
    """
    client = request.headers
    skipped = _NOT_FORWARDED_UP
    connection = client.get("connection")
    if connection is not None:
        named = {token.strip().lower() for token in connection.split(",")}
        if not named <= skipped:  # usually just "keep-alive": nothing new
            skipped = skipped | named
    if "authorization" not in skipped and (authorization is not None or request.get(TENANT) is not None):
        skipped = skipped | _TENANT_KEY
    # One add per header: about half the cost of CIMultiDict(generator) (issue 7's profile).
    headers: CIMultiDict[str] = CIMultiDict()
    for key, value in client.items():
        if key.lower() not in skipped:
            headers.add(key, value)
    chain = client.getall("X-Forwarded-For", None)  # usually none: the client is the first hop
    peer = request.remote
    if chain is None:
        if peer:
            headers["X-Forwarded-For"] = peer
    else:
        headers["X-Forwarded-For"] = ", ".join([*chain, peer] if peer else chain)
    if "X-Forwarded-Proto" not in headers:
        headers["X-Forwarded-Proto"] = request.scheme
    if authorization is not None:
        headers["Authorization"] = authorization
    headers["Content-Type"] = "application/json"
    headers["Accept-Encoding"] = "identity"
    headers[REQUEST_ID_HEADER] = request[REQUEST_ID]
    return headers


def _relayed(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """Replica headers for the client: minus hop-by-hop and the ones aiohttp or Sluice set."""
    relayed: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        if key.lower() not in _NOT_RELAYED_DOWN:
            relayed.add(key, value)
    return relayed


def _record_usage(outcome: RequestOutcome, payload: object, live: LiveRequest) -> None:
    """Take the replica's usage counts, if ``payload`` has them; the real prompt size replaces
    the in-flight entry's estimate."""
    usage = usage_of(payload)
    if usage is None:
        return
    if usage.prompt_tokens is not None:
        outcome.prompt_tokens = usage.prompt_tokens
        live.prompt_tokens = usage.prompt_tokens
    if usage.completion_tokens is not None:
        outcome.completion_tokens = usage.completion_tokens


def _record_native_usage(outcome: RequestOutcome, payload: object, live: LiveRequest) -> None:
    """Token counts from a TGI answer's ``details`` (generated tokens; the prompt when told)."""
    produced = generated_tokens(payload)
    if produced is not None:
        outcome.completion_tokens = produced
    prompt = input_tokens(payload)
    if prompt is not None:
        outcome.prompt_tokens = prompt
        live.prompt_tokens = prompt


def _is_overload_event(event: Event) -> bool:
    """TGI's in-stream refusal: ``{"error": ..., "error_type": "overloaded"}``."""
    if event.data is None or '"overloaded"' not in event.data:
        return False
    try:
        payload = json.loads(event.data)
    except ValueError:
        return False
    return isinstance(payload, dict) and payload.get("error_type") == "overloaded"


def _retry_after_s(value: str | None) -> float | None:
    """A replica's own ``Retry-After`` in seconds (delay-seconds form only, capped at 60 s), or
    ``None``: how long the registry leaves it alone, and the wait Sluice's refusal starts from."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return min(seconds, 60.0) if seconds > 0 and seconds == seconds else None


def _error_message(body: bytes) -> str | None:
    """The ``error.message`` (or ``message``) of a replica's JSON error body, if it has one."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, Mapping):
        return None
    error = payload.get("error")
    if isinstance(error, Mapping) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(error, str):  # TGI: {"error": "...", "error_type": "..."}
        return error
    message = payload.get("message")
    return message if isinstance(message, str) else None


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__
