"""One request's trip to one replica: its state, and how a replica's failure is described.

``Exchange`` is what the forwarding (``gateway.proxy.forward``) and the relay
(``gateway.proxy.relay``) share about one placement of a request; ``ReplicaOverloaded`` is the
signal, raised before any byte reached the client, to place the request again elsewhere.
``describe`` and ``detached`` turn a transport exception into the message an ``UpstreamError``
reports and the cause it chains.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from gateway.api.openai import ParsedRequest
from gateway.config.settings import Settings
from gateway.observability.outcome import RequestOutcome
from gateway.replicas.registry import LiveRequest, Replica

#: Status logged for a request whose client went away before its response was sent (nginx's).
CLIENT_CLOSED_REQUEST = 499


def nothing() -> None:
    """The default of ``Exchange.end`` (an exchange not running yet has nothing to end)."""


@dataclass(slots=True)
class Exchange:
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
    end: Callable[[], None] = nothing
    #: Output tokens its tenant's budget covers (``math.inf``: nothing to charge ahead). A stream
    #: relayed past it is charged ahead (``charge_ahead``) before the next token is written.
    paid_output: float = math.inf
    #: ``charge_ahead(produced)``: charge the next step; the new cover, or ``None`` when the
    #: tenant's budget refused it (the stream stops). ``LiveAdmission.charge_ahead``.
    charge_ahead: Callable[[int], Awaitable[float | None]] | None = None
    #: What its tenant's token budget counts (``tokens`` or ``weighted tokens``), for the message
    #: of a stream the budget stops.
    token_unit: str = "tokens"


class ReplicaOverloaded(Exception):
    """A replica refused the request as overloaded before the client saw anything: place it again.

    ``back_off_s``: how long to leave the replica alone (its Retry-After, else
    ``UNMEASURED_WAIT_S``); Sluice's own refusal, when no placement is left, is computed from it.
    """

    def __init__(self, back_off_s: float, why: str) -> None:
        super().__init__(why)
        self.back_off_s = back_off_s
        self.why = why


def detached(exc: BaseException) -> BaseException:
    """``exc`` without its traceback, to chain as a cause. aiohttp keeps the exception it raised
    on the response's payload stream (``StreamReader.set_exception``), and the traceback it then
    gathers holds the reader's frames here, whose locals hold the response and the exchange: a
    reference cycle that left every object of a failed stream to the cycle collector
    (``tests/integration/gateway/test_no_request_cycles.py``). The message is what the error
    reports (``describe``); the frames were aiohttp's and this module's own."""
    return exc.with_traceback(None)


def describe(exc: BaseException) -> str:
    """``exc`` as ``Class: message`` (just ``Class`` when it has no message), for an error's text."""
    text = str(exc)
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__
