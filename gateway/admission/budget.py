"""The tenant's budget as a port of the admission engine, and its typed refusal.

A budget (``gateway.limits``: per-tenant tokens, requests and concurrency) is asked for a request
before admission decides it: the engine prices the request (``budget_cost``: its prompt and its
predicted output, never below what it is sure to produce: ``sure_output``, weighted; a
response that cannot be stopped part-way reserves its whole output cap: ``reserved_output``),
``TenantBudget.reserve`` answers, and a refused answer is the typed
``BudgetRefused`` (``rate_limit_exceeded``, with a jittered Retry-After from when the budget
really frees: ``budget_retry_after``). An
allowed reservation is settled exactly once: with the tokens the request really cost when it
ends, with nothing (a refund) when admission refuses it or it never reaches a replica.

The port is synchronous so that the engine stays sans-I/O: the replay answers from an in-memory
limiter on its virtual clock; the live gateway, whose limiter may be Redis, fetches the answer
before it submits (``AdmissionEngine.budget_cost`` says whether and at what cost) and hands it
over through the port, and starts its settles as tasks of their own. ``BudgetLedger`` is the
engine's side: what each request holds, from its reservation to its settle, across a
re-placement (a placement its replica refused hands its hold to the next one, never reserving
twice), and when each tenant's running requests are predicted to end (``SlotClock``), the wait a
``max_concurrent`` refusal is told.

A stream that outruns its hold is charged ahead: ``Hold.next_top_up`` says what the next step
costs (pure), the live adapter takes it from the limiter and records it (``Hold.took``), and the
settle charges only what the steps did not (docs/tenants.md, "Hard caps").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from gateway.admission.config import RetryAfterSettings
from gateway.admission.fairness import TokenWeights
from gateway.admission.ports import EngineLog
from gateway.admission.request import AdmissionRequest
from gateway.admission.results import Ending
from gateway.admission.retry_after import (
    UNMEASURED_WAIT_S,
    RefusalReason,
    RetryAfter,
    UniformSource,
    retry_after,
)
from gateway.admission.views import TrackedStream

__all__ = [
    "BudgetAnswer",
    "BudgetLedger",
    "BudgetRefused",
    "Hold",
    "SlotClock",
    "TenantBudget",
    "TopUp",
    "bucket_output_cap",
    "budget_cost",
    "budget_retry_after",
    "context_left",
    "predicted_end",
    "request_cost",
    "reserved_output",
    "sure_output",
]

#: The largest output cap ``bucket_output_cap`` considers when the context is unknown (2**53 - 1,
#: ``gateway.api.openai.MAX_TOKENS_LIMIT``: the most a body's ``max_tokens`` may say).
_MAX_OUTPUT_CAP = 2**53 - 1
#: Weight of the newest duration in ``SlotClock.typical_s`` (an exponential moving average).
_TYPICAL_WEIGHT: Final = 0.2


class BudgetAnswer(Protocol):
    """A limiter's answer to one reservation (``gateway.limits.base.Reservation`` fits).

    ``allowed``: every budget was taken (else none was). ``blocked_by``: the budgets that refused
    it (``tokens``, ``requests``, ``concurrency``; empty when allowed). ``oversize``: the cost
    exceeds what the tenant's token bucket can ever hold. ``retry_after_s``: seconds until the
    buckets hold the cost (``None``: unknown, only a concurrency slot is missing; or never, when
    ``oversize``). ``cost_tokens``: the weighted tokens reserved."""

    @property
    def tenant(self) -> str: ...

    @property
    def allowed(self) -> bool: ...

    @property
    def blocked_by(self) -> frozenset[str]: ...

    @property
    def oversize(self) -> bool: ...

    @property
    def retry_after_s(self) -> float | None: ...

    @property
    def cost_tokens(self) -> float: ...


class TenantBudget(Protocol):
    """The tenants' budgets as the engine uses them; synchronous, no I/O of its own.

    ``weights``: the token weights a reservation for ``model`` is priced with now (``None``: no
    model in particular; weights may differ per model's replica group). ``reserve``: take
    ``cost_tokens`` weighted tokens, one request and one concurrency slot of ``request.tenant``'s
    budget at ``now`` (seconds of the adapter's clock), all or none; ``None`` when that tenant has
    no budget (nothing to enforce, nothing to settle). ``settle``: once per allowed answer, with
    the weighted tokens the request really cost (0.0: a refund); it frees the concurrency slot."""

    def weights(self, model: str | None = None) -> TokenWeights: ...

    def reserve(self, request: AdmissionRequest, cost_tokens: float, now: float) -> BudgetAnswer | None: ...

    def settle(self, answer: BudgetAnswer, actual_cost_tokens: float, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class BudgetRefused:
    """A request refused because its tenant's budget is spent (429 ``rate_limit_exceeded``).

    ``answer``: the limiter's refused reservation (its buckets make the ``x-ratelimit-*``
    headers). ``retry_after``: when to come back (``budget_retry_after``); ``None`` when the
    request can never fit (``oversize``)."""

    tenant: str
    answer: BudgetAnswer
    retry_after: RetryAfter | None

    @property
    def reason(self) -> RefusalReason:
        return RefusalReason.RATE_LIMITED


def request_cost(
    weights: TokenWeights, prompt_tokens: float, output_tokens: float, choices: int = 1
) -> float:
    """Weighted tokens a tenant's token budget is charged for one request (no per-request term):
    one prompt, and ``output_tokens`` in all, decoded as ``choices`` (the body's ``n``) sequences
    of equal length, each reading the prompt as its context. With one choice that is
    ``weights.cost(prompt_tokens, output_tokens, 0.0)``."""
    if choices <= 1:
        return weights.cost(prompt_tokens, output_tokens, 0.0)
    each = output_tokens / choices
    return weights.cost(prompt_tokens, each, 0.0) + (choices - 1) * weights.output_cost(each, prompt_tokens)


def sure_output(
    max_tokens: int | None, *, min_tokens: int = 0, ignore_eos: bool = False, context_left: int | None = None
) -> int:
    """Output tokens per choice a request is sure to produce whatever the model says: with
    ``ignore_eos`` its whole cap (``max_tokens``, else ``context_left``: the engine's default, the
    rest of the largest context; ``None`` when unknown, then ``min_tokens`` only), else
    ``min_tokens`` (vLLM's sampling parameters); never more than ``max_tokens``, never below 0."""
    sure = max(min_tokens, 0)
    if ignore_eos:
        cap = max_tokens if max_tokens is not None else context_left
        if cap is not None:
            sure = max(sure, cap)
    return sure if max_tokens is None else min(sure, max_tokens)


def context_left(max_model_lens: Iterable[int], prompt_tokens: int) -> int | None:
    """The output a request without ``max_tokens`` may produce: the largest of the replicas'
    ``max_model_len`` less its prompt (at least 1 token); ``None`` when no replica is known."""
    longest = max(max_model_lens, default=None)
    return None if longest is None else max(1, longest - prompt_tokens)


def bucket_output_cap(
    weights: TokenWeights, prompt_tokens: int, choices: int, capacity: float, context_left: int | None
) -> int:
    """The largest output per choice (at least 1) whose request a token bucket of ``capacity``
    weighted tokens can hold: the most ``c`` with ``request_cost(weights, prompt_tokens,
    c x choices, choices) <= capacity``, at most ``context_left`` (``None``: unknown, no such
    bound). The cap the gateway sets on a response that cannot be stopped part-way and came
    without ``max_tokens``; 1 when even one token does not fit (the reservation is then refused as
    more than the bucket can ever hold)."""

    def fits(per_choice: int) -> bool:
        return request_cost(weights, prompt_tokens, per_choice * choices, choices) <= capacity

    low, high = 1, max(context_left if context_left is not None else _MAX_OUTPUT_CAP, 1)
    if fits(high):
        return high
    if not fits(low):
        return 1
    while high - low > 1:  # fits(low), not fits(high): the cost grows with the output
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def reserved_output(request: AdmissionRequest) -> int:
    """Output tokens ``request`` reserves, all its choices together: its predicted output (at
    least 1, at most ``max_tokens``, rounded up to whole tokens) for each choice, or, for a
    request that reserves its whole output (``reserve_whole_output``, with ``max_tokens``),
    ``max_tokens`` for each. The engine raises the prediction to what the request is sure to
    produce (``sure_output``)."""
    if request.reserve_whole_output and request.max_tokens is not None:
        return request.max_tokens * request.choices
    output = max(request.expected_output_tokens, 1.0)
    if request.max_tokens is not None:
        output = min(output, float(request.max_tokens))
    whole = max(math.ceil(output), 1) if math.isfinite(output) else max(request.max_tokens or 1, 1)
    return whole * request.choices


def budget_cost(weights: TokenWeights, request: AdmissionRequest) -> float:
    """Weighted tokens ``request`` reserves: its prompt and its predicted output
    (``reserved_output``), priced by ``request_cost``."""
    return request_cost(weights, request.prompt_tokens, reserved_output(request), request.choices)


def budget_retry_after(
    answer: BudgetAnswer, slot_wait_s: float, settings: RetryAfterSettings, rng: UniformSource
) -> RetryAfter | None:
    """The Retry-After of a refused reservation, jittered (``retry_after``: drawn in ``[d, d x (1
    + jitter)]``, so never before the budget frees unless that is past ``max_s / (1 + jitter)``),
    ``d`` the wait until every budget that refused it frees: the limiter's wait until its token
    and request buckets refill to this request's cost and, when a concurrency slot is missing,
    ``slot_wait_s`` (seconds until the tenant's earliest running request is predicted to end:
    ``SlotClock.wait_s``), the longer of the two. ``None`` (not retryable) when the request can
    never fit."""
    if answer.oversize:
        return None
    wait = answer.retry_after_s
    if wait is None:
        wait = slot_wait_s
    elif "concurrency" in answer.blocked_by:
        wait = max(wait, slot_wait_s)
    return retry_after(RefusalReason.RATE_LIMITED, wait, settings, rng)


def predicted_end(stream: TrackedStream[Any], now: float) -> float | None:
    """When ``stream`` is predicted to end, seconds of the engine's clock (never before ``now``):
    its first token ``predicted_ttft_s`` after its dispatch (or now, if that is past), then one
    token per ``predicted_tpot_s`` up to its predicted output; a stream with tokens ends after its
    remaining predicted output, at least one more token. ``None``: no forecast (no finite TTFT,
    or no TPOT > 0)."""
    tpot, ttft = stream.predicted_tpot_s, stream.predicted_ttft_s
    if not (math.isfinite(tpot) and tpot > 0.0 and math.isfinite(ttft)):
        return None
    expected = max(stream.expected_output_tokens, 1.0)
    produced = stream.tokens_at(now)
    if produced <= 0:
        return max(stream.live.started_at + ttft, now) + (expected - 1.0) * tpot
    return now + max(expected - produced, 1.0) * tpot


class SlotClock:
    """When a tenant's concurrency slot frees, as this engine knows it: every hold it granted,
    from its reservation to its settle, and the forecast of those running on a replica.

    ``wait_s``: seconds until the earliest of the tenant's running requests is predicted to end
    (``predicted_end``); a running request without a forecast ends the typical duration after its
    reservation; with none running here (all queued, or the slots held by other gateways) the
    typical duration. ``typical_s``: that typical duration, seconds from reservation to settle, a
    moving average over every tenant's released holds (``UNMEASURED_WAIT_S`` before the first).
    Pure: times are the engine's ``now``."""

    def __init__(self) -> None:
        self._holds: dict[str, dict[int, Hold]] = {}
        self._typical_s: float | None = None

    @property
    def typical_s(self) -> float:
        return UNMEASURED_WAIT_S if self._typical_s is None else self._typical_s

    def held(self, hold: Hold) -> None:
        """``hold`` was granted (at ``hold.reserved_at``); it holds a slot until ``released``."""
        self._holds.setdefault(hold.answer.tenant, {})[id(hold)] = hold

    def released(self, hold: Hold, now: float) -> None:
        """``hold`` was settled or refunded at ``now``: its slot is free, its duration learned."""
        tenant = hold.answer.tenant
        holds = self._holds.get(tenant)
        if holds is None or holds.pop(id(hold), None) is None:
            return
        if not holds:
            del self._holds[tenant]
        duration = max(now - hold.reserved_at, 0.0)
        typical = self._typical_s
        self._typical_s = duration if typical is None else typical + _TYPICAL_WEIGHT * (duration - typical)

    def holding(self, tenant: str) -> int:
        """Holds of ``tenant`` granted here and not released."""
        return len(self._holds.get(tenant, ()))

    def wait_s(self, tenant: str, now: float) -> float:
        """Seconds (>= 0) until one of ``tenant``'s running requests is predicted to end (see the
        class)."""
        typical = self.typical_s
        earliest = math.inf
        for hold in self._holds.get(tenant, {}).values():
            stream = hold.stream
            if stream is None:
                continue  # queued, or between two placements: not running
            end = predicted_end(stream, now)
            earliest = min(earliest, hold.reserved_at + typical if end is None else end)
        return typical if earliest == math.inf else max(earliest - now, 0.0)


@dataclass(frozen=True, slots=True)
class TopUp:
    """One step charged ahead of a stream that outran what its budget covers: ``output_tokens``
    more output (all choices) at ``cost_tokens`` weighted tokens."""

    output_tokens: int
    cost_tokens: float


@dataclass(slots=True)
class Hold:
    """An allowed reservation: the limiter's answer, the weights it was priced with, the prompt
    estimate and output (all choices) it reserved, and the request's choices (settled with the
    same weights).

    ``output_cap``: the most output tokens (all choices) the request may produce (``max_tokens``
    per choice; ``None``: unknown, the replica's context decides). ``covered_output``: output
    tokens the budget holds for it, the reservation's and every step charged ahead since
    (``next_top_up``); ``ahead_cost``: the weighted tokens those steps took, already charged for
    good, so its settle charges only the rest. ``reserved_at``: when it was reserved (the
    engine's clock, seconds). ``stream``: the request as admission tracks it while it runs on a
    replica (``None`` while queued or between placements): its forecast end frees its slot."""

    answer: BudgetAnswer
    weights: TokenWeights
    prompt_tokens: int
    output_tokens: int
    choices: int
    output_cap: int | None = None
    reserved_at: float = 0.0
    covered_output: int = field(init=False)
    ahead_cost: float = 0.0
    stream: TrackedStream[Any] | None = None

    def __post_init__(self) -> None:
        self.covered_output = self.output_tokens

    def next_top_up(self, produced: int) -> TopUp | None:
        """What to charge ahead once ``produced`` output tokens (all choices) were seen: ``None``
        while they are covered or once the cover reaches ``output_cap`` (nothing more can come);
        else one step of the reservation's own output (more when ``produced`` jumped past it),
        never past ``output_cap``. Steps of the reserved size keep the settle's charge (the cost
        less ``ahead_cost``) from going below 0: only the last step can go unused."""
        covered, cap = self.covered_output, self.output_cap
        if produced <= covered or (cap is not None and covered >= cap):
            return None
        step = max(self.output_tokens, produced - covered)
        if cap is not None:
            step = min(step, cap - covered)
        before = request_cost(self.weights, self.prompt_tokens, covered, self.choices)
        after = request_cost(self.weights, self.prompt_tokens, covered + step, self.choices)
        return TopUp(step, max(after - before, 0.0))

    def took(self, top_up: TopUp) -> None:
        """``top_up`` was charged: the budget now covers its output too."""
        self.covered_output += top_up.output_tokens
        self.ahead_cost += top_up.cost_tokens


class BudgetLedger:
    """The engine's bookkeeping over a ``TenantBudget``: reserve, refund, settle, and the holds
    of placements a replica refused, parked for the request's next placement.

    Parked holds are keyed by (tenant, request id): an adapter that places a request again does
    so before anything else can submit (the live adapter's ``finish`` and next ``submit`` run in
    one loop step), so requests sharing a client-chosen id never take each other's hold.
    ``log``: where a settle that raised is reported. ``rng`` and ``retry_settings`` (the
    settings in force, read at each refusal): a refusal's jittered Retry-After
    (``budget_retry_after``). ``slots``: when each tenant's held requests end."""

    def __init__(
        self,
        budget: TenantBudget,
        log: EngineLog,
        *,
        rng: UniformSource,
        retry_settings: Callable[[], RetryAfterSettings] = RetryAfterSettings,
    ) -> None:
        self.budget = budget
        self._log = log
        self._rng = rng
        self._retry_settings = retry_settings
        self._parked: dict[tuple[str, str], list[Hold]] = {}
        #: ``cost``'s last answer: (the request, the weights it was priced with, its reserved
        #: output, its cost), so that ``reserve`` of the same request holds what ``cost`` priced
        #: (the answer an adapter fetched at that cost), not the weights of a moment later.
        self._priced: tuple[AdmissionRequest, TokenWeights, int, float] | None = None
        self.slots = SlotClock()

    def cost(self, request: AdmissionRequest) -> float | None:
        """The weighted tokens ``reserve`` will take for ``request``; ``None`` when it takes
        nothing (no tenant, or a hold parked for it)."""
        if request.tenant is None or self._parked.get((request.tenant, request.request_id)):
            return None
        weights = self.budget.weights(request.model)
        output = reserved_output(request)
        cost = request_cost(weights, request.prompt_tokens, output, request.choices)
        self._priced = (request, weights, output, cost)
        return cost

    def reserve(self, request: AdmissionRequest, now: float) -> Hold | BudgetRefused | None:
        """Reserve ``request``'s cost of its tenant's budget (or take the hold its previous,
        refused placement parked); ``None`` when nothing is held for it."""
        tenant = request.tenant
        if tenant is None:
            return None
        parked = self._parked.get((tenant, request.request_id))
        if parked:
            hold = parked.pop(0)
            if not parked:
                del self._parked[(tenant, request.request_id)]
            return hold
        priced, self._priced = self._priced, None
        if priced is not None and priced[0] is request:
            # The adapter reserved ``cost``'s answer with the limiter already: the hold keeps the
            # weights that answer was priced with, even if the weights in force moved since.
            weights, output, cost = priced[1], priced[2], priced[3]
        else:
            weights = self.budget.weights(request.model)
            output = reserved_output(request)
            cost = request_cost(weights, request.prompt_tokens, output, request.choices)
        answer = self.budget.reserve(request, cost, now)
        if answer is None:
            return None
        if not answer.allowed:
            slot_wait = self.slots.wait_s(tenant, now)
            retry = budget_retry_after(answer, slot_wait, self._retry_settings(), self._rng)
            return BudgetRefused(tenant, answer, retry)
        cap = None if request.max_tokens is None else request.max_tokens * request.choices
        hold = Hold(
            answer,
            weights,
            request.prompt_tokens,
            output,
            request.choices,
            output_cap=cap,
            reserved_at=now,
        )
        self.slots.held(hold)
        return hold

    def running(self, hold: Hold | None, stream: TrackedStream[Any]) -> None:
        """The request holding ``hold`` was sent to a replica and runs as ``stream``."""
        if hold is not None:
            hold.stream = stream

    def park(self, hold: Hold, request: AdmissionRequest) -> None:
        """Keep ``hold`` for ``request``'s next placement (its replica refused this one)."""
        hold.stream = None
        self._parked.setdefault((hold.answer.tenant, request.request_id), []).append(hold)

    def refund(self, hold: Hold | None, now: float) -> None:
        """Give a refused (or never sent) request's reservation back whole."""
        self._settle(hold, 0.0, now)

    def settle(self, hold: Hold, ending: Ending, produced: int, now: float) -> None:
        """Settle a request that reached its replica with what it really cost: the replica's
        prompt count, else the estimate reserved; its output tokens (``produced``: usage, else
        the tokens seen); when neither says and output did come (``ending.answered``), the
        output covered. Steps charged ahead (``Hold.ahead_cost``) are taken off: they were
        charged already (the charge never goes below 0)."""
        prompt = hold.prompt_tokens if ending.prompt_tokens is None else ending.prompt_tokens
        if ending.produced_tokens is None and produced == 0 and ending.answered:
            produced = hold.covered_output
        cost = request_cost(hold.weights, prompt, produced, hold.choices)
        self._settle(hold, max(cost - hold.ahead_cost, 0.0), now)

    def _settle(self, hold: Hold | None, actual_cost_tokens: float, now: float) -> None:
        if hold is None:
            return
        hold.stream = None
        self.slots.released(hold, now)
        try:
            self.budget.settle(hold.answer, actual_cost_tokens, now)
        except Exception:
            self._log.exception("settling tenant %r's budget failed", hold.answer.tenant)
