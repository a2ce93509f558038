"""Step time (seconds) of one engine iteration, from measured per-layer timings plus roofline terms.

``step = overhead + layers x linear(tokens) + TP all-reduces + decode attention + prefill
attention + LM head``: ``linear`` is interpolated in the profile's measured table (Vidur), the
context-dependent attention terms come from bytes and FLOPs. Pure functions of the profile and the
batch; the caller applies jitter with its own seeded generator (:func:`jitter_factor`). Details in
docs/emulator.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simulator.profile import Profile, StepModelParams

#: Two all-reduces per transformer layer under tensor parallelism (after attention and after MLP),
#: as Megatron-style sharding (and vLLM's RowParallelLinear) does.
ALLREDUCES_PER_LAYER = 2


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes, per sequence.

    ``prefill_chunks``: ``(chunk_tokens, context_tokens)`` per sequence that is (re)computing its
    prompt: ``chunk_tokens`` new tokens on top of ``context_tokens`` already in its KV cache.
    ``decode_contexts``: per decoding sequence, the KV tokens its attention reads (context + the one
    new token).
    """

    prefill_chunks: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens computed by prefill chunks."""
        return sum(chunk for chunk, _ in self.prefill_chunks)

    @property
    def num_decode_seqs(self) -> int:
        """Sequences decoding one token."""
        return len(self.decode_contexts)

    @property
    def num_tokens(self) -> int:
        """Tokens the linear layers process: prefill tokens + one per decode."""
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def num_seqs(self) -> int:
        """Sequences in the step; each produces one row of logits."""
        return len(self.prefill_chunks) + len(self.decode_contexts)

    @property
    def num_kv_tokens_read(self) -> int:
        """KV tokens touched by attention: context + new tokens of every sequence."""
        return sum(c + ctx for c, ctx in self.prefill_chunks) + sum(self.decode_contexts)


class CostModel:
    """Step-time model of one profile. Immutable after construction; every method is pure."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        points = sorted(profile.cost.linear_ms_per_layer.items())
        self._n = np.array([n for n, _ in points], dtype=np.float64)
        # The raw medians, wiggles included: GEMM tile and wave quantisation make a step of 136 tokens
        # slower than one of 128 on real GPUs too, so no smoothing is applied.
        self._ms = np.array([ms for _, ms in points], dtype=np.float64)
        self._tail_slope_ms = _tail_slope(self._n, self._ms)

    def linear_layer_s(self, num_tokens: int) -> float:
        """Seconds of one layer's linear operators at ``num_tokens`` tokens (0 for an empty step).

        Interpolated in the measured table (times ``linear_scale``); beyond its last point the time
        grows linearly with the slope of its upper half, where every GEMM is compute-bound.
        """
        if num_tokens <= 0:
            return 0.0
        last_n = float(self._n[-1])
        if num_tokens <= last_n:
            ms = float(np.interp(num_tokens, self._n, self._ms))
        else:
            ms = float(self._ms[-1]) + self._tail_slope_ms * (num_tokens - last_n)
        return ms * self.profile.cost.linear_scale / 1e3

    def linear_s(self, num_tokens: int) -> float:
        """Seconds of all layers' linear operators at ``num_tokens`` tokens."""
        return self.profile.model.num_layers * self.linear_layer_s(num_tokens)

    def allreduce_s(self, num_tokens: int) -> float:
        """Seconds of the tensor-parallel all-reduces of one step (0 at tensor_parallel = 1).

        Each all-reduce moves num_tokens x hidden activations; a ring all-reduce's time is
        latency + bytes x 2(p-1)/p / bus bandwidth (nccl-tests' definition of bus bandwidth).
        """
        p = self.profile.tensor_parallel
        if p == 1 or num_tokens <= 0:
            return 0.0
        m, gpu = self.profile.model, self.profile.gpu
        message_bytes = num_tokens * m.hidden_size * m.dtype_bytes
        one = gpu.allreduce_latency_s + message_bytes * 2 * (p - 1) / p / gpu.allreduce_bus_bandwidth_Bps
        return ALLREDUCES_PER_LAYER * m.num_layers * one

    def decode_attention_s(self, decode_contexts: tuple[int, ...]) -> float:
        """Seconds of decode attention: every decoding sequence reads its whole KV cache once.

        Memory-bound at every batch size (arithmetic intensity ~ the GQA group size), so
        KV bytes read / achieved HBM bandwidth.
        """
        return sum(decode_contexts) * self.profile.kv_bytes_per_token / self._bandwidth()

    def prefill_attention_s(self, prefill_chunks: tuple[tuple[int, int], ...]) -> float:
        """Seconds of prefill attention, per chunk the larger of its FLOP time and its KV-read time.

        A chunk of c tokens over a context of k tokens does QK^T and PV for c queries against
        k + (c + 1) / 2 keys on average (causal): 4 x layers x heads/TP x head_dim x c x (k + (c+1)/2)
        FLOPs. A short chunk on a long context is bound by reading the k cached tokens instead.
        """
        m, p = self.profile.model, self.profile.tensor_parallel
        flops_per_pair = 4 * m.num_layers * (m.num_heads // p) * m.head_dim
        total = 0.0
        for chunk, context in prefill_chunks:
            flops = flops_per_pair * chunk * (context + (chunk + 1) / 2)
            kv_bytes = (context + chunk) * self.profile.kv_bytes_per_token
            total += max(flops / self._flops(), kv_bytes / self._bandwidth())
        return total

    def lm_head_s(self, num_seqs: int) -> float:
        """Seconds of the LM head: one vocab x hidden GEMM row per scheduled sequence.

        Memory-bound (reading the vocab x hidden / TP weight) at small batch, compute-bound at large.
        """
        if num_seqs <= 0:
            return 0.0
        m, p = self.profile.model, self.profile.tensor_parallel
        weight_bytes = m.vocab_size * m.hidden_size * m.dtype_bytes / p
        flops = 2 * num_seqs * m.vocab_size * m.hidden_size / p
        return max(weight_bytes / self._bandwidth(), flops / self._flops())

    def step_time_s(self, shape: StepShape) -> float:
        """Seconds of one engine step of this composition, without jitter (0 for an empty step)."""
        if shape.num_seqs == 0:
            return 0.0
        return (
            self.profile.cost.per_step_overhead_s
            + self.linear_s(shape.num_tokens)
            + self.allreduce_s(shape.num_tokens)
            + self.decode_attention_s(shape.decode_contexts)
            + self.prefill_attention_s(shape.prefill_chunks)
            + self.lm_head_s(shape.num_seqs)
        )

    def _bandwidth(self) -> float:
        return self.profile.gpu.hbm_bandwidth_Bps * self.profile.cost.hbm_efficiency

    def _flops(self) -> float:
        return self.profile.gpu.peak_bf16_flops * self.profile.cost.attention_flops_efficiency


class StepModelCost:
    """Step-time model of a profile that carries a fitted step model (``Profile.step_model``).

    Prices a step with the step model's linear formula on the step's composition: tokens through
    the weights (prefill chunks plus one per decode), decoding sequences, KV tokens the decodes
    read, and prefill attention pairs (``chunk x (chunk / 2 + context)`` per chunk). Same
    interface as :class:`CostModel`; immutable, pure.
    """

    def __init__(self, profile: Profile, params: StepModelParams) -> None:
        self.profile = profile
        self.params = params

    def step_time_s(self, shape: StepShape) -> float:
        """Seconds of one engine step of this composition, without jitter (0 for an empty step)."""
        if shape.num_seqs == 0:
            return 0.0
        p = self.params
        tokens = shape.num_tokens
        pairs = sum(chunk * (chunk / 2 + context) for chunk, context in shape.prefill_chunks)
        return (
            p.base_s
            + p.per_token_s * min(tokens, p.knee_tokens)
            + p.per_compute_token_s * max(0.0, tokens - p.knee_tokens)
            + p.per_decode_seq_s * shape.num_decode_seqs
            + p.per_kv_token_s * sum(shape.decode_contexts)
            + p.per_attn_pair_s * pairs
        )


def cost_model_for(profile: Profile) -> CostModel | StepModelCost:
    """The step-time model an engine of ``profile`` runs: its fitted step model when it carries
    one, else the per-layer table and roofline terms."""
    if profile.step_model is not None:
        return StepModelCost(profile, profile.step_model)
    return CostModel(profile)


def step_time_s(profile: Profile, shape: StepShape) -> float:
    """Convenience: ``cost_model_for(profile).step_time_s`` for a one-off call (builds the model
    each time)."""
    return cost_model_for(profile).step_time_s(shape)


def jitter_factor(rng: np.random.Generator, relative_sd: float) -> float:
    """A multiplicative factor with mean 1 and standard deviation ``relative_sd`` (lognormal).

    Returns exactly 1.0 when ``relative_sd`` is 0, without consuming the generator.
    """
    if relative_sd <= 0:
        return 1.0
    sigma2 = math.log1p(relative_sd * relative_sd)
    return float(np.exp(rng.normal(-sigma2 / 2, math.sqrt(sigma2))))


def _tail_slope(n: np.ndarray, ms: np.ndarray) -> float:
    """Least-squares slope (ms per token) of the table's upper half, used to extrapolate past it."""
    upper = n >= n[-1] / 2
    if int(upper.sum()) < 2:
        upper[-2:] = True
    slope = float(np.polyfit(n[upper], ms[upper], 1)[0])
    return max(slope, 0.0)
