"""Tenant fairness when the fleet is saturated: a Virtual Token Counter per tenant (VTC).

What it does
    Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024): each tenant has a
    counter of the service it received, in weighted tokens divided by its fair-share weight. When
    several tenants have requests waiting in Sluice's queue, the one with the smallest counter is
    served first (``AdmissionQueue`` does the ordering; this module keeps the counters). Over any
    period in which two tenants are both backlogged, their weighted service then differs by a
    bounded amount (the paper proves ``2U``, U the largest single request's weighted tokens), so
    each gets its weighted share of GPU time, whatever its request sizes. Counting requests
    instead would hand a tenant sending long documents most of the GPU. (The bound assumes the
    least-served tenant's request is placed first; when it cannot be placed now, Sluice's queue
    offers the others' requests rather than leave capacity idle, and its counter, still the
    smallest, puts it first again as soon as it fits; ``reserve_after_s`` bounds how long.)

Inputs consumed
    ``TokenWeights``: the cost of one prompt token (``input``), one output token (``output``), one
    request (``request``) and, per output token, one token of the context it reads (``context``:
    VTC's profiled cost has this ``x·y`` term, the KV read of decoding, so an output token after a
    4000-token document costs more than one after a short chat), in any one unit (only ratios
    matter). ``TokenWeights()`` is VTC's
    1 : 2; ``AdmissionController`` starts from ``from_queue_settings``: the queue's job-size costs
    in seconds per token (``admission.queue.prompt_token_cost_s`` and ``output_token_cost_s``),
    or ``REQUEST_COUNT`` (every request 1, tokens 0: request-count fairness) with
    ``admission.queue.fairness: requests``. The live gateway charges, with ``fairness: tokens``,
    the tenants' budget weights instead (``LiveAdmission.token_weights``, i.e.
    ``gateway.tenants.live.Tenancy.weights``: with GPU-time weights the mean over the models'
    replica groups of a prompt and an output token's GPU time, else ``limits.token_weights``),
    so that a tenant's fair share is a share of GPU time and of the currency its budget pays
    in. Tenant
    weights (> 0) from the tenants' configuration; a tenant not listed weighs 1. The tenant key is
    ``AdmissionRequest.tenant``; ``None`` (no tenant) is one tenant like any other.

When service is charged
    * prompt (and the per-request cost) at dispatch, by the admission core, when the request
      leaves for a replica (``charge_dispatch``): the prefill is about to happen;
    * output as it is produced, by the gateway (``charge_output``), either per streamed chunk or
      once with the total when the request ends (a request cut short is charged the tokens it
      produced), with the context they were produced after (``context_tokens``: the prompt, plus
      the output charged before) for the ``context`` weight. Charging per chunk keeps the
      counters current while long streams run; charging at the end lags each counter by the
      output of that tenant's requests in flight, a bounded amount, so long-run shares are the
      same either way.

No banked credit
    A tenant whose queue goes from empty to non-empty is lifted to the smallest counter of the
    other backlogged tenants (never lowered): it cannot save up service while idle and then
    crowd out the others. When no other tenant is backlogged, the floor is the *virtual time*:
    the largest counter any dispatched request's tenant had just before its dispatch. Under
    saturation that is the counter of the tenant being served, so a tenant returning at a moment
    when the queue happens to be empty gets no credit either; and the service a tenant got while
    nobody else wanted it is forgiven, as fair queuing should (the others start level with it).

Trade-offs
    One float per tenant; ``enqueued`` is O(tenants) on an empty-to-non-empty transition (a min
    over backlogged tenants), everything else O(1). Counters only grow; float64 keeps unit
    increments exact up to ~10^15 weighted tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gateway.admission.config import QueueSettings

__all__ = ["REQUEST_COUNT", "TenantKey", "TokenWeights", "VirtualTokenCounter", "output_context"]

#: The tenant a request belongs to (``AdmissionRequest.tenant``); ``None``: no tenant.
TenantKey = str | None


@dataclass(frozen=True, slots=True)
class TokenWeights:
    """What one unit of service costs, in weighted tokens (any one unit; only ratios matter).

    ``input``: per prompt token (w_in). ``output``: per output token (w_out). ``request``: per
    request, whatever its size (0 by default; with ``input = output = 0`` the counters count
    requests, which is request-count fairness). ``context``: per output token and per token of
    context it is produced after (w_ctx; 0 by default): the ``i``-th output token (from 1) of a
    request with ``P`` prompt tokens adds ``w_ctx x (P + i - 1)``. Each finite and >= 0, not all 0.
    """

    input: float = 1.0
    output: float = 2.0
    request: float = 0.0
    context: float = 0.0

    def __post_init__(self) -> None:
        for name in ("input", "output", "request", "context"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} weight must be finite and >= 0, got {value!r}")
        if self.input == self.output == self.request == 0:
            raise ValueError("at least one token weight must be > 0")

    @classmethod
    def from_queue_settings(cls, queue: QueueSettings) -> TokenWeights:
        """The queue's job-size costs (seconds per prompt and per output token) as weights; with
        ``queue.fairness == "requests"``, one per request and nothing per token."""
        if queue.fairness == "requests":
            return REQUEST_COUNT
        return cls(input=queue.prompt_token_cost_s, output=queue.output_token_cost_s)

    def cost(self, prompt_tokens: float, output_tokens: float, requests: float = 1.0) -> float:
        """Weighted tokens of ``requests`` requests totalling these prompt and output tokens (the
        ``context`` term as for one request: ``output_context(prompt_tokens, output_tokens)``)."""
        weighted = self.input * prompt_tokens + self.output * output_tokens + self.request * requests
        if self.context:
            weighted += self.context * output_context(prompt_tokens, output_tokens)
        return weighted

    def output_cost(self, output_tokens: float, context_tokens: float = 0.0) -> float:
        """Weighted tokens of ``output_tokens`` produced one after another after
        ``context_tokens`` tokens of context: ``output x n + context x output_context(ctx, n)``."""
        weighted = self.output * output_tokens
        if self.context:
            weighted += self.context * output_context(context_tokens, output_tokens)
        return weighted


def output_context(context_tokens: float, output_tokens: float) -> float:
    """Tokens of context ``output_tokens`` output tokens read, produced one after another after
    ``context_tokens``: ``n x ctx + n (n - 1) / 2`` (0 for no output)."""
    n = max(output_tokens, 0.0)
    return n * context_tokens + n * max(n - 1.0, 0.0) / 2.0


class VirtualTokenCounter:
    """Per-tenant virtual token counters, backlog counts and the lift rule. Pure, synchronous.

    The queue calls ``enqueued``/``dequeued`` as entries come and go and ``charge_dispatch`` when
    it dispatches one; the controller calls ``charge_dispatch`` for requests admitted at once;
    the gateway calls ``charge_output`` as output is produced.
    """

    def __init__(
        self, token_weights: TokenWeights | None = None, tenant_weights: Mapping[str, float] | None = None
    ) -> None:
        self._tokens = token_weights if token_weights is not None else TokenWeights()
        self._weights: dict[str, float] = {}
        self._counters: dict[TenantKey, float] = {}
        self._served: dict[TenantKey, float] = {}
        self._backlog: dict[TenantKey, int] = {}
        self._virtual_time = 0.0
        if tenant_weights is not None:
            self.set_tenant_weights(tenant_weights)

    def __repr__(self) -> str:
        return f"VirtualTokenCounter({self._tokens}, {len(self._counters)} tenants)"

    @property
    def token_weights(self) -> TokenWeights:
        """The weights charges use now."""
        return self._tokens

    def set_token_weights(self, weights: TokenWeights) -> None:
        """Charge future service with ``weights`` (e.g. after the step model was recalibrated);
        counters keep their values."""
        self._tokens = weights

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """Fair-share weights by tenant (each finite and > 0; absent tenants weigh 1). Applies to
        future charges; counters keep their values (hot reload)."""
        for tenant, weight in weights.items():
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"weight of tenant {tenant!r} must be finite and > 0, got {weight!r}")
        self._weights = dict(weights)

    def weight(self, tenant: TenantKey) -> float:
        """``tenant``'s fair-share weight (1 when not configured)."""
        return self._weights.get(tenant, 1.0) if tenant is not None else 1.0

    def counter(self, tenant: TenantKey) -> float:
        """``tenant``'s counter: weighted tokens served divided by its weight, plus lifts (0 at first)."""
        return self._counters.get(tenant, 0.0)

    def counters(self) -> dict[TenantKey, float]:
        """Every tenant's counter (a copy), for metrics and tests."""
        return dict(self._counters)

    def served(self, tenant: TenantKey) -> float:
        """Weighted tokens charged to ``tenant`` so far (not divided by its weight, no lifts)."""
        return self._served.get(tenant, 0.0)

    def backlog(self, tenant: TenantKey) -> int:
        """``tenant``'s requests waiting in the queue."""
        return self._backlog.get(tenant, 0)

    @property
    def virtual_time(self) -> float:
        """The floor of a tenant that becomes backlogged while no other is: the largest counter a
        tenant had just before one of its requests was dispatched."""
        return self._virtual_time

    def enqueued(self, tenant: TenantKey) -> None:
        """One more of ``tenant``'s requests waits. On its first, lift its counter (see module doc)."""
        waiting = self._backlog.get(tenant, 0)
        self._backlog[tenant] = waiting + 1
        if waiting == 0:
            self._counters[tenant] = max(self.counter(tenant), self._floor(tenant))

    def _floor(self, tenant: TenantKey) -> float:
        others = [self.counter(t) for t, n in self._backlog.items() if n > 0 and t != tenant]
        return min(others) if others else self._virtual_time

    def dequeued(self, tenant: TenantKey) -> None:
        """One of ``tenant``'s waiting requests left the queue (dispatched, rejected, cancelled)."""
        waiting = self._backlog.get(tenant, 0)
        if waiting <= 0:
            raise ValueError(f"tenant {tenant!r} has no request waiting")
        if waiting == 1:
            del self._backlog[tenant]
        else:
            self._backlog[tenant] = waiting - 1

    def charge_dispatch(self, tenant: TenantKey, prompt_tokens: float) -> float:
        """Charge a request sent to a replica: ``input x prompt_tokens + request``. Returns the
        counter increment (weighted tokens / tenant weight)."""
        _check_tokens(prompt_tokens)
        self._virtual_time = max(self._virtual_time, self.counter(tenant))
        return self._charge(tenant, self._tokens.cost(prompt_tokens, 0.0))

    def charge_output(self, tenant: TenantKey, output_tokens: float, context_tokens: float = 0.0) -> float:
        """Charge ``output_tokens`` (>= 0) produced for ``tenant`` after ``context_tokens`` (>= 0:
        the request's prompt, plus its output charged before): ``TokenWeights.output_cost``. Call
        per streamed chunk or once at the end. Returns the counter increment."""
        _check_tokens(output_tokens)
        _check_tokens(context_tokens)
        return self._charge(tenant, self._tokens.output_cost(output_tokens, context_tokens))

    def _charge(self, tenant: TenantKey, weighted: float) -> float:
        increment = weighted / self.weight(tenant)
        self._counters[tenant] = self.counter(tenant) + increment
        self._served[tenant] = self.served(tenant) + weighted
        return increment


#: Request-count fairness: every request costs 1, whatever its size.
REQUEST_COUNT: Final = TokenWeights(input=0.0, output=0.0, request=1.0)


def _check_tokens(tokens: float) -> None:
    if not (math.isfinite(tokens) and tokens >= 0):
        raise ValueError(f"a token count must be finite and >= 0, got {tokens!r}")
