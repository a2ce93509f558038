"""The tenant's budget as a port of the admission engine, and its typed refusal.

A budget (``gateway.limits``: per-tenant tokens, requests and concurrency) is asked for a request
before admission decides it: the engine prices the request (``budget_cost``: its prompt and its
predicted output, never below what it is sure to produce: ``sure_output``, weighted; a
response that cannot be stopped part-way reserves its whole output cap: ``reserved_output``),
``TenantBudget.reserve`` answers, and a refused answer is the typed
``BudgetRefused`` (``rate_limit_exceeded``, the bucket's exact wait as its Retry-After). An
allowed reservation is settled exactly once: with the tokens the request really cost when it
ends, with nothing (a refund) when admission refuses it or it never reaches a replica.

The port is synchronous so that the engine stays sans-I/O: the replay answers from an in-memory
limiter on its virtual clock; the live gateway, whose limiter may be Redis, fetches the answer
before it submits (``AdmissionEngine.budget_cost`` says whether and at what cost) and hands it
over through the port, and starts its settles as tasks of their own. ``BudgetLedger`` is the
engine's side: what each request holds, from its reservation to its settle, across a
re-placement (a placement its replica refused hands its hold to the next one, never reserving
twice).

A stream that outruns its hold is charged ahead: ``Hold.next_top_up`` says what the next step
costs (pure), the live adapter takes it from the limiter and records it (``Hold.took``), and the
settle charges only what the steps did not (docs/tenants.md, "Hard caps").
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.admission.fairness import TokenWeights
from gateway.admission.ports import EngineLog
from gateway.admission.request import AdmissionRequest
from gateway.admission.results import Ending
from gateway.admission.retry_after import (
    UNMEASURED_WAIT_S,
    RefusalReason,
    RetryAfter,
    retry_after,
)

__all__ = [
    "BudgetAnswer",
    "BudgetLedger",
    "BudgetRefused",
    "Hold",
    "TenantBudget",
    "TopUp",
    "bucket_output_cap",
    "budget_cost",
    "budget_retry_after",
    "context_left",
    "request_cost",
    "reserved_output",
    "sure_output",
]

#: The largest output cap ``bucket_output_cap`` considers when the context is unknown (2**53 - 1,
#: ``gateway.api.openai.MAX_TOKENS_LIMIT``: the most a body's ``max_tokens`` may say).
_MAX_OUTPUT_CAP = 2**53 - 1


class BudgetAnswer(Protocol):
    """A limiter's answer to one reservation (``gateway.limits.base.Reservation`` fits).

    ``allowed``: every budget was taken (else none was). ``oversize``: the cost exceeds what the
    tenant's token bucket can ever hold. ``retry_after_s``: seconds until the buckets hold the
    cost (``None``: unknown, only a concurrency slot is missing; or never, when ``oversize``).
    ``cost_tokens``: the weighted tokens reserved."""

    @property
    def tenant(self) -> str: ...

    @property
    def allowed(self) -> bool: ...

    @property
    def oversize(self) -> bool: ...

    @property
    def retry_after_s(self) -> float | None: ...

    @property
    def cost_tokens(self) -> float: ...


class TenantBudget(Protocol):
    """The tenants' budgets as the engine uses them; synchronous, no I/O of its own.

    ``weights``: the token weights a reservation is priced with now. ``reserve``: take
    ``cost_tokens`` weighted tokens, one request and one concurrency slot of ``request.tenant``'s
    budget at ``now`` (seconds of the adapter's clock), all or none; ``None`` when that tenant has
    no budget (nothing to enforce, nothing to settle). ``settle``: once per allowed answer, with
    the weighted tokens the request really cost (0.0: a refund); it frees the concurrency slot."""

    def weights(self) -> TokenWeights: ...

    def reserve(self, request: AdmissionRequest, cost_tokens: float, now: float) -> BudgetAnswer | None: ...

    def settle(self, answer: BudgetAnswer, actual_cost_tokens: float, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class BudgetRefused:
    """A request refused because its tenant's budget is spent (429 ``rate_limit_exceeded``).

    ``answer``: the limiter's refused reservation (its buckets make the ``x-ratelimit-*``
    headers). ``retry_after``: the bucket's exact wait (no jitter); ``None`` when the request can
    never fit (``oversize``)."""

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


def budget_retry_after(answer: BudgetAnswer) -> RetryAfter | None:
    """The Retry-After of a refused reservation: the limiter's exact wait; the unmeasured wait
    when only a concurrency slot is missing (one frees when a request ends, time unknown);
    ``None`` (not retryable) when the request can never fit."""
    if answer.oversize:
        return None
    wait = answer.retry_after_s
    return retry_after(RefusalReason.RATE_LIMITED, UNMEASURED_WAIT_S if wait is None else wait)


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
    good, so its settle charges only the rest."""

    answer: BudgetAnswer
    weights: TokenWeights
    prompt_tokens: int
    output_tokens: int
    choices: int
    output_cap: int | None = None
    covered_output: int = field(init=False)
    ahead_cost: float = 0.0

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
    ``log``: where a settle that raised is reported."""

    def __init__(self, budget: TenantBudget, log: EngineLog) -> None:
        self.budget = budget
        self._log = log
        self._parked: dict[tuple[str, str], list[Hold]] = {}

    def cost(self, request: AdmissionRequest) -> float | None:
        """The weighted tokens ``reserve`` will take for ``request``; ``None`` when it takes
        nothing (no tenant, or a hold parked for it)."""
        if request.tenant is None or self._parked.get((request.tenant, request.request_id)):
            return None
        return budget_cost(self.budget.weights(), request)

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
        weights = self.budget.weights()
        answer = self.budget.reserve(request, budget_cost(weights, request), now)
        if answer is None:
            return None
        if not answer.allowed:
            return BudgetRefused(tenant, answer, budget_retry_after(answer))
        cap = None if request.max_tokens is None else request.max_tokens * request.choices
        return Hold(
            answer, weights, request.prompt_tokens, reserved_output(request), request.choices, output_cap=cap
        )

    def park(self, hold: Hold, request: AdmissionRequest) -> None:
        """Keep ``hold`` for ``request``'s next placement (its replica refused this one)."""
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
        try:
            self.budget.settle(hold.answer, actual_cost_tokens, now)
        except Exception:
            self._log.exception("settling tenant %r's budget failed", hold.answer.tenant)
