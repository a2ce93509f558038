"""The tenant's budget as a port of the admission engine, and its typed refusal.

A budget (``gateway.limits``: per-tenant tokens, requests and concurrency) is asked for a request
before admission decides it: the engine prices the request (``budget_cost``: its prompt and its
predicted output, weighted), ``TenantBudget.reserve`` answers, and a refused answer is the typed
``BudgetRefused`` (``rate_limit_exceeded``, the bucket's exact wait as its Retry-After). An
allowed reservation is settled exactly once: with the tokens the request really cost when it
ends, with nothing (a refund) when admission refuses it or it never reaches a replica.

The port is synchronous so that the engine stays sans-I/O: the replay answers from an in-memory
limiter on its virtual clock; the live gateway, whose limiter may be Redis, fetches the answer
before it submits (``AdmissionEngine.budget_cost`` says whether and at what cost) and hands it
over through the port, and starts its settles as tasks of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from gateway.admission.fairness import TokenWeights
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import UNMEASURED_WAIT_S, RefusalReason, RetryAfter, retry_after

__all__ = [
    "BudgetAnswer",
    "BudgetRefused",
    "TenantBudget",
    "budget_cost",
    "budget_retry_after",
    "request_cost",
    "reserved_output",
]


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


def reserved_output(request: AdmissionRequest) -> int:
    """Output tokens ``request`` reserves, all its choices together: its predicted output (at
    least 1, at most ``max_tokens``, rounded up to whole tokens) for each choice."""
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
