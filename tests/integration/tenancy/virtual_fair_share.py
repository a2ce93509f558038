"""The fair-share scenario of ``test_fairness`` in virtual time: the same policy, deterministic.

No processes, no wall clock: the real simulator engine (``fair_share.GpuTimeEngine``, the
emulated Llama-3-8B/H100 replica of the live test, ``ENGINE_SEQS`` sequences at once) is stepped
on a virtual clock; the gateway's part is the product's own pieces, driven as the live gateway
drives them: ``VirtualTokenCounter`` (the fair-share counters, their lift rule and charges: the
prompt at dispatch, the output with the context it read when the request ends), and token
weights from ``gateway.tenancy.step_model_prices`` and ``split_context`` on a step model that
``predictor.StepCalibrator`` fits to the engine's steps as they run (refitted and repriced every
``REFRESH_S``; VTC's 1 : 2 until the first fit). At most ``SLOTS`` requests are on the engine
at once; whenever one finishes, the tenant with the smallest counter among the backlogged (both,
always: closed loop, more clients than slots) sends the next.

A tenant's GPU time is ``GpuTimeEngine``'s: every step split among its sequences by the cost
model's terms; in virtual time a step's replica time is its emulated duration (no process to
wait for), so what the live test adds on a loaded machine is absent here, and only the policy
and its prices are judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from gateway.admission import TokenWeights, VirtualTokenCounter
from gateway.admission.fairness import REQUEST_COUNT
from gateway.prediction.facts import ReplicaFacts
from gateway.tenancy import DEFAULT_WEIGHTS, split_context, step_model_prices
from predictor.calibrate import StepCalibrator
from predictor.step_model import StepBatch
from simulator.profile import load_profile
from tests.integration.tenancy.fair_share import ENGINE_SEQS, SHAPES, SLOTS, GpuTimeEngine, engine_profile

#: Virtual seconds between two refits and repricings (the live gateway: ``WEIGHTS_REFRESH_S``).
REFRESH_S: Final = 1.0
#: Virtual seconds of steps the batch the prices are taken at is averaged over (the live
#: gateway: its scrape window).
BATCH_WINDOW_S: Final = 5.0


@dataclass
class VirtualRun:
    """Each tenant's GPU seconds (``GpuTimeEngine.replica_s``) at ``start_s`` and at the end,
    requests finished in between, and the token weights in force at the end."""

    start_s: float
    end_s: float
    gpu_at_start: dict[str, float] = field(default_factory=dict)
    gpu_at_end: dict[str, float] = field(default_factory=dict)
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SHAPES, 0))
    weights: TokenWeights = DEFAULT_WEIGHTS

    def shares(self) -> dict[str, float]:
        """Each tenant's share (0-1) of the GPU time the two used between start and end."""
        used = {t: self.gpu_at_end.get(t, 0.0) - self.gpu_at_start.get(t, 0.0) for t in SHAPES}
        total = sum(used.values())
        return {t: v / total for t, v in used.items()}


def _by_tenant(engine: GpuTimeEngine) -> dict[str, float]:
    tenant_of = {shape.prompt_tokens: tenant for tenant, shape in SHAPES.items()}
    out = dict.fromkeys(SHAPES, 0.0)
    for prompt, seconds in engine.replica_s.items():
        out[tenant_of[prompt]] += seconds
    return out


def simulate(
    directory: Path,
    weights: Mapping[str, float],
    fairness: str = "tokens",
    *,
    window_s: tuple[float, float] = (8.0, 40.0),
) -> VirtualRun:
    """Both tenants backlogged from 0 s to ``window_s[1]``; GPU shares over ``window_s``.
    ``fairness``: ``"tokens"`` (weights from the fitted step model) or ``"requests"``."""
    engine = GpuTimeEngine(load_profile(str(engine_profile(directory))), seed=3)
    prior = ReplicaFacts(
        gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=ENGINE_SEQS, max_num_batched_tokens=8192
    ).prior()
    calibrator = StepCalibrator(prior)
    counter = VirtualTokenCounter(REQUEST_COUNT if fairness == "requests" else DEFAULT_WEIGHTS, weights)
    run = VirtualRun(*window_s)
    tenant_of: dict[str, str] = {}
    #: (at, output tokens, KV read, decodes, seconds) per step
    steps: list[tuple[float, int, int, int, float]] = []
    #: (at, prompt tokens of its request, tokens computed) per prefill chunk
    prompts: list[tuple[float, int, int]] = []
    now, refresh_at, sequence, on_engine = 0.0, REFRESH_S, 0, 0
    for tenant in SHAPES:
        for _ in range(SHAPES[tenant].clients):
            counter.enqueued(tenant)

    def dispatch(at: float) -> None:
        nonlocal sequence, on_engine
        while on_engine < SLOTS:
            tenant = min(SHAPES, key=lambda t: (counter.counter(t), t))
            counter.dequeued(tenant)
            counter.charge_dispatch(tenant, SHAPES[tenant].prompt_tokens)
            sequence += 1
            rid = f"{tenant}-{sequence}"
            tenant_of[rid] = tenant
            shape = SHAPES[tenant]
            engine.add_request(rid, shape.prompt_tokens, shape.output_tokens, shape.output_tokens, at)
            on_engine += 1

    def reprice(at: float) -> None:
        model = calibrator.fit(at).model
        recent = [s for s in steps if s[0] >= at - BATCH_WINDOW_S]
        chunks = [n for t, _, n in prompts if t >= at - BATCH_WINDOW_S]
        lengths = [p for t, p, _ in prompts if t >= at - BATCH_WINDOW_S]
        if fairness != "tokens" or not model.valid or not recent or not chunks:
            return
        # Output tokens per step (as the replica's counters give it: generation tokens / steps)
        # and KV tokens each decode read.
        decodes = sum(s[1] for s in recent) / len(recent)
        context = sum(s[2] for s in recent) / max(1, sum(s[3] for s in recent))
        # The pairs per prompt token the fit saw: the prompts' token-weighted mean length.
        prompt = sum(p * n for p, n in zip(lengths, chunks, strict=True)) / sum(chunks)
        prices = step_model_prices(
            model,
            max_num_batched_tokens=8192,
            max_num_seqs=ENGINE_SEQS,
            decode_seqs=decodes,
            context_tokens=context,
            prompt_tokens=prompt,
        )
        if prices is None:
            return
        per_kv = model.params.per_kv_token_s or prior.params.per_kv_token_s
        split = split_context(prices.decode_s, per_kv, context, prices.prefill_s)
        counter.set_token_weights(
            TokenWeights(input=1.0, output=round(split.ratio, 2), context=float(f"{split.context_ratio:.3g}"))
        )

    dispatch(now)
    while now < run.end_s:
        if now >= run.start_s and not run.gpu_at_start:
            run.gpu_at_start = _by_tenant(engine)
        plan = engine.schedule(now)
        assert plan is not None, "the engine ran dry: the tenants must stay backlogged"
        live = engine._in_flight_requests
        chunks = [
            (live[rid].prompt_tokens, n, live[rid].num_computed_tokens)
            for rid, n in plan.num_scheduled_tokens.items()
            if n > 1 or live[rid].num_output_tokens == 0
        ]
        pairs = sum(n * (ctx + n / 2.0) for _, n, ctx in chunks)
        batch = StepBatch(plan.num_prefill_tokens, plan.num_decode_seqs, plan.num_kv_tokens_read, pairs)
        calibrator.observe_step(now, batch, plan.duration_s)
        prompts.extend((now, prompt, n) for prompt, n, _ in chunks)
        started, now = now, now + plan.duration_s
        result = engine.complete(plan, now)
        outputs = sum(event.num_new_tokens for event in result.events)
        steps.append((started, outputs, plan.num_kv_tokens_read, plan.num_decode_seqs, plan.duration_s))
        for done in result.finished:
            tenant = tenant_of.pop(done.request_id)
            counter.charge_output(tenant, done.generation_tokens, context_tokens=done.prompt_tokens)
            counter.enqueued(tenant)  # its client sends the next one at once
            on_engine -= 1
            if run.start_s <= now < run.end_s:
                run.finished[tenant] += 1
        if now >= refresh_at:
            reprice(now)
            refresh_at = now + REFRESH_S
        dispatch(now)
    run.gpu_at_end = _by_tenant(engine)
    run.weights = counter.token_weights
    return run
