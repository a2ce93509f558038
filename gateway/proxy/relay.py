"""Relaying a replica's answer to the client: a whole body, a stream event by event, or its error.

``Relay`` reads what the replica sends once its headers arrived and writes it to the client: a
non-streamed answer whole (``relay_body``), an SSE stream one write per event (``relay_stream``,
with the first token, tokens streamed and usage recorded on the exchange as they pass), a
replica 4xx unchanged (but a prompt longer than the context as OpenAI's
``context_length_exceeded``) and a 5xx as a 502 (``relay_error``), an overload refusal as the signal to
place again (``overloaded``). A stream cut after its headers ends with an error event, never a
fake ``[DONE]``. A stream that outruns what its tenant's budget covers is charged ahead before
its next token is written (``pay_ahead``), or ends with a ``rate_limit_exceeded`` error event
when the budget refuses (``end_over_budget``). Transport failures count against the replica
(``replica_failed``, ``replica_timed_out``) and become ``UpstreamError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Callable, Mapping

import aiohttp
from aiohttp import web

from gateway.admission.retry_after import UNMEASURED_WAIT_S, RefusalReason
from gateway.api.responses import carries_tokens, is_usage_only_chunk, usage_of
from gateway.api.sse import DONE, Event, EventSplitter
from gateway.api.tgi import (
    error_event,
    generated_tokens,
    input_tokens,
    is_final_event,
    is_token_event,
    without_details,
)
from gateway.http.echo import clip
from gateway.http.error_middleware import log_error
from gateway.http.errors import (
    GatewayError,
    Refused,
    UpstreamError,
    replica_context_error,
    sse_error_event,
)
from gateway.observability.logs import REQUEST_ID
from gateway.observability.outcome import RequestOutcome
from gateway.proxy.exchange import Exchange, ReplicaOverloaded, describe, detached
from gateway.proxy.headers import relayed
from gateway.replicas.registry import LiveRequest, Replica, ReplicaRegistry

log = logging.getLogger("sluice.proxy")

#: Largest replica error body read when passing a 4xx through or reporting a 5xx, in bytes.
MAX_ERROR_BODY = 1024 * 1024
#: Replica statuses that mean "overloaded, try elsewhere" (TGI: 429 past max_concurrent_requests).
OVERLOAD_STATUSES = frozenset({429, 503})


class Relay:
    """Reads a replica's answer and relays it; one per ``Proxy``.

    ``registry`` is told of transport failures and timeouts (``on_replica_failure``, when given,
    is called after a failure: a health recheck); ``clock`` (seconds, monotonic) stamps tokens.
    """

    def __init__(
        self,
        registry: ReplicaRegistry,
        on_replica_failure: Callable[[], None] | None,
        clock: Callable[[], float],
    ) -> None:
        self._registry = registry
        self._on_replica_failure = on_replica_failure
        self._clock = clock

    def replica_failed(self, replica: Replica, exc: BaseException) -> None:
        """A connection-level failure counts as a failed health check and triggers a recheck."""
        self._registry.report_failure(replica, f"proxy: {describe(exc)}")
        if self._on_replica_failure is not None:
            self._on_replica_failure()

    def replica_timed_out(self, replica: Replica, exc: BaseException) -> None:
        """A read or connect timeout: counted towards ejecting the replica (its /health may still
        answer while its generation is stuck, so a health recheck would prove nothing)."""
        self._registry.report_timeout(replica, f"proxy: {describe(exc)}")

    async def read_upstream(
        self, ex: Exchange, upstream: aiohttp.ClientResponse, limit: int | None = None
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
            self.replica_timed_out(ex.replica, exc)
            message = f"replica {ex.replica.name} timed out"
            raise UpstreamError(message, detail=describe(exc)) from detached(exc)
        except aiohttp.ClientError as exc:
            self.replica_failed(ex.replica, exc)
            message = f"replica {ex.replica.name} failed mid-response"
            raise UpstreamError(message, detail=describe(exc)) from detached(exc)

    async def overloaded(self, ex: Exchange, upstream: aiohttp.ClientResponse) -> ReplicaOverloaded:
        """The replica's own overload refusal, read and turned into a signal to place again."""
        body = await self.read_upstream(ex, upstream, MAX_ERROR_BODY)
        ex.overloaded = True
        back_off = retry_after_s(upstream.headers.get("Retry-After")) or UNMEASURED_WAIT_S
        detail = clip(error_message(body) or upstream.reason or "")
        return ReplicaOverloaded(back_off, f"answered {upstream.status}: {detail}".strip())

    async def relay_error(self, ex: Exchange, upstream: aiohttp.ClientResponse) -> web.Response:
        """Replica 4xx: relayed unchanged (status and body), but a 400 saying the request is longer
        than the context becomes OpenAI's ``context_length_exceeded`` (``replica_context_error``).
        Replica 5xx: 502 naming the replica and its status; what the replica said goes to the
        log only."""
        body = await self.read_upstream(ex, upstream, MAX_ERROR_BODY)
        if upstream.status >= 500:
            detail = error_message(body) or upstream.reason or None
            raise UpstreamError(f"replica {ex.replica.name} answered {upstream.status}", detail=detail)
        ex.outcome.status, ex.outcome.error = upstream.status, "replica_rejected"
        message = error_message(body)
        log.info(
            "request %s: replica %s answered %d: %s",
            ex.outcome.request_id,
            ex.replica.name,
            upstream.status,
            clip(message or "-"),
        )
        too_long = (
            None
            if upstream.status != 400 or message is None
            else replica_context_error(message, ex.parsed.endpoint)
        )
        if too_long is not None:
            raise too_long
        return web.Response(status=upstream.status, body=body, headers=relayed(upstream.headers))

    async def relay_body(self, ex: Exchange, upstream: aiohttp.ClientResponse) -> web.Response:
        """A non-streaming answer: read it whole (it is one JSON object), take usage, relay it."""
        body = await self.read_upstream(ex, upstream)
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
            record_native_usage(ex.outcome, payload, ex.live)
        else:
            record_usage(ex.outcome, payload, ex.live)
        if ex.parsed.native and not ex.parsed.details:
            body = without_details(body)  # Sluice asked for them; the client did not
        # Answered here, before the request's bookkeeping (admission's and the predictor's
        # finish, the outcome listeners, the settle, the access line), not after it by aiohttp:
        # that work is then off the client's path, as a stream's is. The response hooks (request
        # id, prediction and rate-limit headers) run in ``prepare`` as before; a client gone by
        # now ends the exchange as a disconnect (``_exchange``).
        response = ex.response = web.Response(
            status=upstream.status, body=body, headers=relayed(upstream.headers)
        )
        await response.prepare(ex.request)
        await response.write_eof()
        return response

    async def first_events(
        self, ex: Exchange, upstream: aiohttp.ClientResponse, splitter: EventSplitter
    ) -> list[Event]:
        """Read until the stream's first event with data is complete (or the stream ends); returns
        the events read so far, for ``relay_stream`` to relay first."""
        events: list[Event] = []
        while not any(e.data is not None for e in events):
            chunk = await self.next_chunk(ex, upstream)
            if not chunk:
                break
            events += splitter.feed(chunk)
        return events

    async def relay_stream(
        self,
        ex: Exchange,
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
        inspect = self.inspect_native if native else self.inspect
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
                        if ex.live.tokens_streamed > ex.paid_output and not done and not finishing(event):
                            await self.pay_ahead(ex)
                        await write(ex, response, event.raw)
                chunk = await self.next_chunk(ex, upstream)
                if not chunk:
                    break
                events = splitter.feed(chunk)
            if not done:
                last = "its final event" if native else "[DONE]"
                raise UpstreamError(f"replica {ex.replica.name} ended the stream before {last}")
        except UpstreamError as err:
            await self.end_with_error(ex, response, err)
        except Refused as err:
            await self.end_over_budget(ex, response, err)
        return response

    async def end_over_budget(self, ex: Exchange, response: web.StreamResponse, err: Refused) -> None:
        """End a stream its tenant's budget stopped: the error event, then the stream's end as
        usual (the connection stays open: nothing broke). The upstream response is closed after
        (``Proxy._exchange``), so the replica aborts the request."""
        ex.outcome.error = err.code
        log_error(err, ex.request.get(REQUEST_ID))
        event = (
            error_event(err.message, err.code or err.error_type) if ex.parsed.native else sse_error_event(err)
        )
        await write(ex, response, event)

    async def pay_ahead(self, ex: Exchange) -> None:
        """The stream produced more than its tenant's budget covers (``Exchange.paid_output``):
        charge the next step before its next token is relayed; raises ``Refused`` (429
        ``rate_limit_exceeded``, ended as an error event) when the budget refuses it."""
        charge = ex.charge_ahead
        paid = math.inf if charge is None else await charge(ex.live.tokens_streamed)
        if paid is None:
            raise _stream_over_budget(ex.live.tokens_streamed - 1, ex.outcome.tenant, ex.token_unit)
        ex.paid_output = paid

    async def next_chunk(self, ex: Exchange, upstream: aiohttp.ClientResponse) -> bytes:
        """The next bytes of the stream as they arrive (``b""`` at its end)."""
        try:
            return await upstream.content.readany()
        except TimeoutError as exc:
            self.replica_timed_out(ex.replica, exc)
            message = f"replica {ex.replica.name} timed out mid-stream"
            raise UpstreamError(message, detail=describe(exc)) from detached(exc)
        except aiohttp.ClientError as exc:
            self.replica_failed(ex.replica, exc)
            message = f"replica {ex.replica.name} failed mid-stream"
            raise UpstreamError(message, detail=describe(exc)) from detached(exc)

    def inspect(self, ex: Exchange, event: Event) -> bool:
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
        record_usage(outcome, payload, ex.live)
        return ex.parsed.include_usage or not is_usage_only_chunk(payload)

    def inspect_native(self, ex: Exchange, event: Event) -> bool:
        """``inspect`` for a TGI ``/generate_stream``: one event per generated token, the last
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
            record_native_usage(ex.outcome, payload, live)
            if ex.outcome.completion_tokens is None:
                ex.outcome.completion_tokens = live.tokens_streamed
        elif isinstance(payload, dict) and "error" in payload:
            ex.outcome.error = "upstream_error"
            ex.stream_done = True  # TGI ends the stream after an error event
        return True

    async def end_with_error(self, ex: Exchange, response: web.StreamResponse, err: GatewayError) -> None:
        ex.outcome.error = err.code
        log_error(err, ex.request.get(REQUEST_ID))
        response.force_close()
        event = (
            error_event(err.message, err.code or err.error_type) if ex.parsed.native else sse_error_event(err)
        )
        with contextlib.suppress(ConnectionResetError):
            await write(ex, response, event)


#: Bytes HTTP/1.1 chunked encoding adds to one write, at most (size line and CRLFs).
CHUNK_FRAMING = 32


async def write(ex: Exchange, response: web.StreamResponse, data: bytes) -> None:
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
        and transport.get_write_buffer_size() + len(data) + CHUNK_FRAMING
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


def record_usage(outcome: RequestOutcome, payload: object, live: LiveRequest) -> None:
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
    if usage.cached_tokens is not None:
        outcome.cached_tokens = usage.cached_tokens


def record_native_usage(outcome: RequestOutcome, payload: object, live: LiveRequest) -> None:
    """Token counts from a TGI answer's ``details`` (generated tokens; the prompt when told)."""
    produced = generated_tokens(payload)
    if produced is not None:
        outcome.completion_tokens = produced
    prompt = input_tokens(payload)
    if prompt is not None:
        outcome.prompt_tokens = prompt
        live.prompt_tokens = prompt


def finishing(event: Event) -> bool:
    """Whether an OpenAI stream chunk ends a choice (a ``finish_reason`` set): its last token, or
    none (vLLM's closing chunk, which the hot path counts as one). Relayed uncharged past a
    stream's cover: the choice produces nothing more, and its settle charges it. Parsed only when
    a stream passes its cover."""
    if event.data is None or "finish_reason" not in event.data:
        return False
    try:
        payload = json.loads(event.data)
    except ValueError:
        return False
    choices = payload.get("choices") if isinstance(payload, dict) else None
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


def _stream_over_budget(relayed: int, tenant: str | None, unit: str) -> Refused:
    """The error event that stops a stream whose tenant's token budget refused to cover more,
    worded as the budget's 429s are (``gateway.admission.live_budget.rejection_message``);
    ``unit``: what the budget counts (``tokens`` or ``weighted tokens``)."""
    return Refused(
        RefusalReason.RATE_LIMITED,
        f"Rate limit reached for tenant {tenant} on {unit} per min (TPM): this stream outran "
        f"its token reservation and the budget holds no more; it was stopped after {relayed} output "
        "tokens.",
        retry_after=None,
    )


def is_overload_event(event: Event) -> bool:
    """TGI's in-stream refusal: ``{"error": ..., "error_type": "overloaded"}``."""
    if event.data is None or '"overloaded"' not in event.data:
        return False
    try:
        payload = json.loads(event.data)
    except ValueError:
        return False
    return isinstance(payload, dict) and payload.get("error_type") == "overloaded"


def retry_after_s(value: str | None) -> float | None:
    """A replica's own ``Retry-After`` in seconds (delay-seconds form only, capped at 60 s), or
    ``None``: how long the registry leaves it alone, and the wait Sluice's refusal starts from."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return min(seconds, 60.0) if seconds > 0 and seconds == seconds else None


def error_message(body: bytes) -> str | None:
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
