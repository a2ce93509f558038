"""The tenants' budgets on the live path: the engine's ``TenantBudget`` over the async limiter.

The engine's budget port is synchronous (``gateway.admission.budget``); the gateway's limiter
(Redis or memory) is not. So ``LiveAdmission.admit`` asks the engine what it will reserve
(``AdmissionEngine.budget_cost``), awaits the limiter for it here (``LiveBudget.fetch``: a
storage failure under ``fail_closed`` is the 503 ``limiter_unavailable``), and hands the answer
to the engine, which decides on it; a refused answer comes back as ``BudgetRefused`` and becomes
the 429 (``over_budget``). An allowed reservation is kept on the request (``RESERVATION``): its
buckets give every response of that request OpenAI's ``x-ratelimit-*`` headers
(``add_rate_limit_headers``), a later refusal's included.

Settles start as tasks of their own, synchronously, from the engine's ``finish``/refund (no
``await`` in between, so no cancellation can skip one) and are not awaited: a response is never
delayed by a Redis round trip. ``drain`` awaits the outstanding ones before the limiter closes.
Each reservation has a fresh id (``new_request_id``), never the request's: a client-chosen
``x-request-id`` repeated on concurrent requests must not look like one retried call.

A stream that outruns what its reservation covers is charged ahead (``charge``): one step of
tokens taken from the tenant's token bucket alone (no request, no concurrency slot), all or
none, and charged for good at once (its lease settled at its cost); a refusal stops the stream.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Final, Protocol

from aiohttp import web

from gateway.admission.budget import BudgetAnswer, BudgetRefused
from gateway.admission.fairness import TokenWeights
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import RefusalReason, RetryAfter, retry_after
from gateway.http.errors import Refused
from gateway.http.rate_limit_headers import go_duration, ietf_rate_limit_headers, rate_limit_headers
from gateway.limits.base import (
    BucketState,
    Limiter,
    LimiterUnavailable,
    Reservation,
    TenantLimits,
    rejection_reason,
)
from gateway.observability.logs import new_request_id
from gateway.observability.outcome import RequestOutcome

__all__ = [
    "DRAIN_TIMEOUT_S",
    "RESERVATION",
    "BudgetMetrics",
    "LiveBudget",
    "add_rate_limit_headers",
    "is_unlimited",
    "over_budget",
    "rate_limit_headers_hook",
    "refunded",
    "rejection_message",
    "token_unit",
]

log = logging.getLogger("sluice.tenancy")

#: Seconds ``drain`` waits for outstanding settles (at shutdown, before the limiter closes).
DRAIN_TIMEOUT_S: Final = 10.0
#: The allowed reservation of a request (its buckets as reserved): its ``x-ratelimit-*`` headers.
RESERVATION: Final = web.RequestKey("tenant_reservation", Reservation)
_UNLIMITED: Final = TenantLimits()


class BudgetMetrics(Protocol):
    """What the budget reports (``gateway.observability.metrics.SluiceMetrics`` fits)."""

    def observe_reservation(self, reservation: Reservation) -> None: ...

    def observe_settle(self, reservation: Reservation, actual_cost_tokens: float) -> None: ...


def is_unlimited(limits: TenantLimits) -> bool:
    """True when ``limits`` bound nothing (no bucket and no concurrency limit)."""
    return limits == _UNLIMITED or (
        limits.tokens_per_minute is None
        and limits.requests_per_minute is None
        and limits.max_concurrent is None
    )


class LiveBudget:
    """The engine's ``TenantBudget`` over the gateway's limiter (see the module).

    ``weights``: the token weights a reservation is priced with now (``Tenancy.weights``);
    ``model_weights``: those for a given model (``Tenancy.weights(model)``: its replica group's),
    ``None``: ``weights`` for every model. ``metrics``: where reservations and settles are
    reported (``None``: nowhere).
    ``retry_backoff_s``: the Retry-After base of a 503 when the limiter's storage is down."""

    def __init__(
        self,
        limiter: Limiter,
        weights: Callable[[], TokenWeights],
        *,
        model_weights: Callable[[str], TokenWeights] | None = None,
        metrics: BudgetMetrics | None = None,
        retry_backoff_s: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self.limiter = limiter
        self._weights = weights
        self._model_weights = model_weights
        self.metrics = metrics
        self._retry_backoff_s = retry_backoff_s
        self._fetched: dict[int, Reservation] = {}
        self._pending: set[asyncio.Task[None]] = set()
        #: Settles started (one per allowed reservation) and the ones whose limiter call raised.
        self.settles_started = 0
        self.settle_failures = 0

    @property
    def pending_settles(self) -> int:
        """Settles started and not finished yet."""
        return len(self._pending)

    # -- before the engine decides ------------------------------------------------------------------
    async def fetch(
        self,
        request: web.Request,
        areq: AdmissionRequest,
        cost_tokens: float,
        limits: TenantLimits,
        outcome: RequestOutcome,
    ) -> None:
        """Reserve ``cost_tokens`` of ``areq.tenant``'s budget under ``limits`` for the engine's
        next ``reserve`` of ``areq``; an allowed answer is kept on ``request`` (``RESERVATION``).
        Raises the 503 ``limiter_unavailable`` (recorded on ``outcome``) when the limiter's
        storage is down and it fails closed."""
        tenant = areq.tenant
        assert tenant is not None
        try:
            answer = await self.limiter.reserve(
                tenant, cost_tokens=cost_tokens, limits=limits, request_id=new_request_id()
            )
        except LimiterUnavailable as exc:
            reason = RefusalReason.LIMITER_UNAVAILABLE
            retry = retry_after(reason, self._retry_backoff_s())
            outcome.decision, outcome.reason = "rejected", "limiter_unavailable"
            outcome.retry_after_s = retry.delay_s
            message = "the tenants' rate-limit storage is unavailable; retry later"
            raise Refused(reason, message, retry_after=retry, detail=str(exc)) from None
        if self.metrics is not None:
            self.metrics.observe_reservation(answer)
        if answer.allowed:
            request[RESERVATION] = answer
        self._fetched[id(areq)] = answer

    def forget(self, areq: AdmissionRequest) -> None:
        """Drop an answer fetched for ``areq`` that the engine did not take."""
        self._fetched.pop(id(areq), None)

    # -- the port -----------------------------------------------------------------------------------
    def weights(self, model: str | None = None) -> TokenWeights:
        if model is None or self._model_weights is None:
            return self._weights()
        return self._model_weights(model)

    def reserve(self, request: AdmissionRequest, cost_tokens: float, now: float) -> BudgetAnswer | None:
        return self._fetched.pop(id(request), None)

    def settle(self, answer: BudgetAnswer, actual_cost_tokens: float, now: float) -> None:
        if not isinstance(answer, Reservation):
            raise TypeError(f"not a limiter's reservation: {answer!r}")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop left (the app is gone): the lease expires on its own
        self.settles_started += 1
        task = loop.create_task(self._settle(answer, actual_cost_tokens), name="sluice-settle")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _settle(self, answer: Reservation, actual_cost_tokens: float) -> None:
        try:
            await self.limiter.settle(answer, actual_cost_tokens=actual_cost_tokens)
        except Exception:
            self.settle_failures += 1
            # Once, then every 1000th: a broken limiter must not flood the log at request rate.
            if self.settle_failures % 1000 == 1:
                log.exception("settle failed for tenant %s (%d so far)", answer.tenant, self.settle_failures)
            return
        if self.metrics is not None:
            self.metrics.observe_settle(answer, actual_cost_tokens)

    # -- charging a stream ahead ----------------------------------------------------------------------
    @staticmethod
    def charges_tokens(answer: BudgetAnswer) -> bool:
        """Whether ``answer``'s tenant has a token bucket (else nothing is charged ahead)."""
        return isinstance(answer, Reservation) and answer.limits.tokens_per_minute is not None

    async def charge(self, answer: BudgetAnswer, cost_tokens: float) -> bool | None:
        """Take ``cost_tokens`` more from the token bucket of ``answer``'s tenant, all or none,
        for good: True taken (or no token bucket), False refused (the bucket does not hold
        them), ``None`` when the limiter's storage is down (nothing taken).

        The bucket alone is asked (the tenant's token limits, no request or concurrency
        budget); the lease the limiter makes is settled at once at ``cost_tokens`` (a task, as
        every settle). Cancelled while the limiter answers, a step taken is refunded whole."""
        if not isinstance(answer, Reservation) or answer.limits.tokens_per_minute is None:
            return True
        limits = TenantLimits(
            tokens_per_minute=answer.limits.tokens_per_minute, token_burst=answer.limits.token_burst
        )
        task = asyncio.get_running_loop().create_task(
            self.limiter.reserve(
                answer.tenant, cost_tokens=cost_tokens, limits=limits, request_id=new_request_id()
            ),
            name="sluice-charge-ahead",
        )
        try:
            step = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._refund_step)
            raise
        except LimiterUnavailable:
            return None
        if self.metrics is not None:
            self.metrics.observe_reservation(step)
        if not step.allowed:
            return False
        self.settle(step, cost_tokens, 0.0)
        return True

    def _refund_step(self, task: asyncio.Task[Reservation]) -> None:
        """A step whose stream was cancelled while the limiter answered: give it back."""
        if task.cancelled() or task.exception() is not None:
            return
        step = task.result()
        if step.allowed:
            self.settle(step, 0.0, 0.0)

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Wait until every settle started so far has finished (at most ``timeout_s`` seconds)."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)


# -- the 429 -----------------------------------------------------------------------------------------


def token_unit(weights: TokenWeights | None) -> str:
    """What a tenant's token budget counts: ``tokens`` when the weights are plain (a prompt and an
    output token 1 each, nothing per request or per token of context), else ``weighted tokens``."""
    plain = weights is not None and weights.input == weights.output == 1.0
    plain = plain and weights is not None and weights.request == weights.context == 0.0
    return "tokens" if plain else "weighted tokens"


def _limit_words(state: BucketState) -> str:
    """``Limit N`` (per minute), with the bucket's size when it is not the same number."""
    limit, burst = round(state.limit_per_minute), round(state.capacity)
    return f"Limit {limit}" if burst == limit else f"Limit {limit}, Burst {burst}"


def rejection_message(
    reservation: Reservation, retry: RetryAfter | None = None, *, unit: str = "weighted tokens"
) -> str:
    """The 429 message in OpenAI's words: which budget, its limit, what is used and what the
    request asked for, and the wait ``retry`` sends (``None``: retrying cannot help, so what to
    change instead). ``unit``: what the token budget counts (``token_unit``). Never a key."""
    name = reservation.tenant
    tokens = reservation.tokens
    tpm = f"{unit} per min (TPM)"
    if reservation.oversize and tokens is not None:
        return (
            f"Request too large for tenant {name} on {tpm}: {_limit_words(tokens)}, Requested "
            f"{math.ceil(reservation.cost_tokens)}. Lower max_tokens or shorten the prompt (or raise the "
            "tenant's token_burst)."
        )
    reason = rejection_reason(reservation)
    requested = math.ceil(reservation.cost_tokens)
    if reason == "tokens" and tokens is not None:
        what = f"{tpm}: {_limit_words(tokens)}, Used {_used(tokens)}, Requested {requested}"
    elif reason == "requests" and reservation.requests is not None:
        requests = reservation.requests
        what = f"requests per min (RPM): {_limit_words(requests)}, Used {_used(requests)}, Requested 1"
    elif reason == "concurrency" and reservation.concurrency is not None:
        slots = reservation.concurrency
        what = f"concurrent requests: Limit {slots.limit}, In flight {slots.in_flight}, Requested 1"
    else:
        what = reason
    when = (
        "Retrying cannot help."
        if retry is None
        else f"Please try again in {go_duration(retry.milliseconds / 1000)}."
    )
    return f"Rate limit reached for tenant {name} on {what}. {when}"


def _used(state: BucketState) -> int:
    """What the bucket has given out and not yet refilled: its size less what is left (more than
    the size while an extra charge is paid off), whole units: the size less the
    ``x-ratelimit-remaining-*`` header's number."""
    return max(0, math.ceil(state.capacity - state.remaining - 1e-9))


def over_budget(
    refused: BudgetRefused,
    outcome: RequestOutcome,
    weights: TokenWeights | None = None,
    *,
    ietf_headers: bool = False,
) -> Refused:
    """The 429 for a request whose tenant's budget is spent (the engine's Retry-After, the refused
    reservation's ``x-ratelimit-*`` headers, and the IETF fields with ``ietf_headers``), recorded
    on ``outcome``. ``weights``: the token weights reservations are priced with (they name the
    budget's unit in the message)."""
    answer = refused.answer
    assert isinstance(answer, Reservation)
    outcome.decision, outcome.reason = "rejected", rejection_reason(answer)
    message = rejection_message(answer, refused.retry_after, unit=token_unit(weights))
    error = Refused(
        refused.reason,
        message,
        retry_after=refused.retry_after,
        reservation=answer,
        ietf_headers=ietf_headers,
    )
    outcome.retry_after_s = error.retry_after_s
    return error


def refunded(reservation: Reservation) -> Reservation:
    """``reservation`` as its buckets stand once it is refunded whole (a request refused before
    any replica): its tokens and its request back, its reset times that much sooner, its
    concurrency slot free. What the headers of such a refusal say."""

    def back(state: BucketState | None, units: float) -> BucketState | None:
        if state is None or state.limit_per_minute <= 0.0:
            return state
        sooner = units * 60.0 / state.limit_per_minute
        return replace(
            state, remaining=state.remaining + units, reset_after_s=max(0.0, state.reset_after_s - sooner)
        )

    slots = reservation.concurrency
    return replace(
        reservation,
        tokens=back(reservation.tokens, reservation.cost_tokens),
        requests=back(reservation.requests, 1.0),
        concurrency=None if slots is None else replace(slots, in_flight=max(0, slots.in_flight - 1)),
    )


ResponseHook = Callable[[web.BaseRequest, web.StreamResponse], Awaitable[None]]


def rate_limit_headers_hook(ietf_headers: Callable[[], bool] = lambda: False) -> ResponseHook:
    """An ``on_response_prepare`` hook: a request whose budget was reserved carries its
    ``x-ratelimit-*`` headers, as OpenAI's responses do (a stream's, and a refusal's after the
    reservation, too), and the IETF fields while ``ietf_headers()`` (``limits.ietf_headers``)."""

    async def hook(request: web.BaseRequest, response: web.StreamResponse) -> None:
        reservation = request.get(RESERVATION)
        if reservation is not None:
            response.headers.update(rate_limit_headers(reservation))
            if ietf_headers():
                response.headers.update(ietf_rate_limit_headers(reservation))

    return hook


#: The hook without the IETF fields.
add_rate_limit_headers: Final = rate_limit_headers_hook()
