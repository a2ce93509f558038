"""Emulated vLLM replicas for the replay: the emulator's engine (the ground truth), its
``/metrics`` exposition and the gateway's snapshot builder for it; and one engine's capacity.

The predictor never sees a replica's profile: the gateway code only reads its ``/metrics`` text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.replicas.dialects.vllm import VllmDialect
from gateway.replicas.scrape import DEFAULT_WINDOW_S, SnapshotBuilder
from replay.traces import TraceRequest
from simulator.engine import Engine, StepPlan
from simulator.metrics import VllmMetrics, cache_config_labels
from simulator.profile import Profile

__all__ = ["EmulatedReplica", "make_replica", "measure_capacity", "saturation_rate"]


@dataclass(slots=True)
class EmulatedReplica:
    """One emulated vLLM replica: its engine, its ``/metrics`` exposition, the gateway's snapshot
    builder for it, and the step in progress (``plan``, ending at ``plan_end_s`` virtual seconds;
    ``None`` and ``math.inf`` while the engine is idle)."""

    name: str
    engine: Engine
    metrics: VllmMetrics
    builder: SnapshotBuilder
    plan: StepPlan | None = None
    plan_end_s: float = math.inf


def make_replica(
    name: str, profile: Profile, *, seed: int, jitter: float, window_s: float = DEFAULT_WINDOW_S
) -> EmulatedReplica:
    """A replica of ``profile`` whose engine is seeded ``seed``, with relative step-time noise
    ``jitter``; its snapshot builder windows rates over ``window_s`` seconds."""
    p = profile
    engine = Engine(p, seed=seed, jitter=jitter)
    metrics = VllmMetrics(
        engine=engine,
        model_name=p.served_model_name,
        max_model_len=p.engine.max_model_len,
        cache_config=cache_config_labels(
            block_size=p.engine.block_size,
            num_gpu_blocks=p.engine.num_gpu_blocks,
            max_model_len=p.engine.max_model_len,
            overrides=p.cache_config_info(),
        ),
        process_metrics=False,  # process/GC families: irrelevant here and slow to render
    )
    return EmulatedReplica(name, engine, metrics, SnapshotBuilder(name, VllmDialect(), window_s=window_s))


def measure_capacity(
    profile: Profile,
    requests: Sequence[TraceRequest],
    *,
    max_tokens: int = 1000,
    seed: int = 0,
    min_requests: int = 3000,
) -> float:
    """Requests per second one replica sustains for this length mix, at saturation (virtual time).

    The requests' lengths (cycled up to ``min_requests``) all arrive at time 0, so the waiting
    queue never empties and the engine runs as full as its ``max_num_seqs`` and KV cache let it.
    The rate is measured between the 30th and the 90th percentile completion: the first ones are
    the short requests of the first batch (too fast), the last ones an emptying batch.
    """
    if not requests:
        raise ValueError("no requests to measure capacity with")
    engine = Engine(profile, seed=seed, jitter=0.0)
    limit = profile.engine.max_model_len
    total = max(min_requests, len(requests))
    for i in range(total):
        r = requests[i % len(requests)]
        cap = max(r.output_tokens, min(max_tokens, limit - r.prompt_tokens))
        engine.add_request(str(i), r.prompt_tokens, cap, r.output_tokens, 0.0)
    return saturation_rate(engine)


def saturation_rate(engine: Engine) -> float:
    """Run ``engine``'s requests, all added at 0, to the end; the completion rate (requests per
    second) between the 30th and the 90th percentile completion (``measure_capacity``)."""
    now, done = 0.0, list[float]()
    while engine.has_unfinished_requests:
        plan = engine.schedule(now)
        if plan is None:
            break
        now += plan.duration_s
        result = engine.complete(plan, now)
        done.extend(now for _ in result.finished)
    lo, hi = math.floor(0.3 * len(done)), math.floor(0.9 * len(done))
    return float(hi - lo) / (done[hi] - done[lo])
