"""Engine step time (seconds) as a function of the batch's composition.

A linear-in-parameters roofline: a fixed ``base``, two token slopes split at a fixed knee
(``min(N, knee)`` and ``max(0, N - knee)``), and per decoding sequence, per KV token read and per
prefill attention pair costs. The knee and ``alpha = c_a / c_c`` come from hardware and model
facts; the six coefficients (seconds per unit, non-negative) are what ``predictor.calibrate``
fits. The derivation is in docs/predictor.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from predictor.hardware import GpuSpec
from predictor.model import ModelArch

__all__ = [
    "DEFAULT_KNEE_TOKENS",
    "FEATURE_NAMES",
    "IDEAL",
    "UNKNOWN_KNEE_TOKENS",
    "Efficiency",
    "ModelSource",
    "RooflineTerms",
    "StepBatch",
    "StepModel",
    "StepParams",
    "roofline_prior",
    "roofline_terms",
    "step_features",
    "unknown_step_model",
]

#: Knee used when the hardware is unknown: between an A100's (~150) and an H100's (~300) BF16
#: ridge in tokens. On a machine with no knee the fit makes both token slopes equal instead.
DEFAULT_KNEE_TOKENS: Final = 256.0
#: Knee of a replica with no roofline prior (unknown hardware or model): none, step time linear in
#: tokens. A CPU has no weight-read-bound flat region, and a knee the data cannot place lets the
#: fit price every prompt token past it at the weak prior's pull toward zero (prompts priced flat).
UNKNOWN_KNEE_TOKENS: Final = 0.0

#: Names of the six fitted coefficients, in vector order.
FEATURE_NAMES: Final = (
    "base",
    "tokens_to_knee",
    "decode_seqs",
    "tokens_past_knee",
    "kv_tokens",
    "attn_pairs",
)


class ModelSource(StrEnum):
    """Where a step model's coefficients come from."""

    PRIOR = "prior"  # roofline from hardware and model facts only
    FITTED = "fitted"  # fitted to observations (with or without a prior)
    NONE = "none"  # nothing known yet: step_time() is NaN


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The work in one engine step (or the mean over a window of steps). All counts are >= 0.

    ``prefill_tokens``: prompt tokens computed in the step (sum of its prefill chunks).
    ``decode_seqs``: sequences generating one token each.
    ``kv_tokens_read``: KV tokens the decodes attend to (sum of their context lengths).
    ``prefill_attn_pairs``: sum over the step's chunks of ``p x (p/2 + ctx)`` (chunk size p after ctx
    already computed tokens); a whole prompt of P tokens totals P^2/2 however it is chunked.
    """

    prefill_tokens: float = 0.0
    decode_seqs: float = 0.0
    kv_tokens_read: float = 0.0
    prefill_attn_pairs: float = 0.0

    def __post_init__(self) -> None:
        if min(self.prefill_tokens, self.decode_seqs, self.kv_tokens_read, self.prefill_attn_pairs) < 0:
            raise ValueError(f"StepBatch counts must be >= 0: {self}")

    @property
    def tokens(self) -> float:
        """Tokens through the weight GEMMs: prefill tokens plus one per decoding sequence."""
        return self.prefill_tokens + self.decode_seqs


@dataclass(frozen=True, slots=True)
class StepParams:
    """Step-model coefficients (seconds per unit) and the two fixed shape constants.

    ``knee_tokens``: tokens per step where the weight GEMMs turn compute bound.
    ``attn_pair_tokens``: ``alpha``, the model's attention FLOPs per pair over linear FLOPs per
    token (0 when the model is unknown); not used by ``step_time``, only to tie ``c_a`` to ``c_c``.
    """

    base_s: float
    per_token_s: float
    per_decode_seq_s: float
    per_compute_token_s: float
    per_kv_token_s: float
    per_attn_pair_s: float = 0.0
    knee_tokens: float = DEFAULT_KNEE_TOKENS
    attn_pair_tokens: float = 0.0

    def coefficients(self) -> tuple[float, float, float, float, float, float]:
        """The six fitted coefficients, in ``FEATURE_NAMES`` order."""
        return (
            self.base_s,
            self.per_token_s,
            self.per_decode_seq_s,
            self.per_compute_token_s,
            self.per_kv_token_s,
            self.per_attn_pair_s,
        )

    def with_coefficients(self, c: tuple[float, ...] | list[float]) -> StepParams:
        """Same knee and alpha, new coefficients (in ``FEATURE_NAMES`` order)."""
        return StepParams(
            float(c[0]),
            float(c[1]),
            float(c[2]),
            float(c[3]),
            float(c[4]),
            float(c[5]),
            self.knee_tokens,
            self.attn_pair_tokens,
        )


def step_features(batch: StepBatch, knee_tokens: float) -> tuple[float, ...]:
    """The regression features of a batch, in ``FEATURE_NAMES`` order (dot with coefficients = time)."""
    tokens = batch.tokens
    return (
        1.0,
        min(tokens, knee_tokens),
        batch.decode_seqs,
        max(0.0, tokens - knee_tokens),
        batch.kv_tokens_read,
        batch.prefill_attn_pairs,
    )


@dataclass(frozen=True, slots=True)
class StepModel:
    """Step time from batch composition. ``valid`` False means ``step_time`` returns NaN."""

    params: StepParams
    source: ModelSource = ModelSource.PRIOR
    valid: bool = True
    reason: str | None = None

    def step_time(self, batch: StepBatch) -> float:
        """Seconds one engine step carrying ``batch`` takes (NaN when the model is not valid)."""
        if not self.valid:
            return math.nan
        p = self.params
        tokens = batch.tokens
        return (
            p.base_s
            + p.per_token_s * min(tokens, p.knee_tokens)
            + p.per_decode_seq_s * batch.decode_seqs
            + p.per_compute_token_s * max(0.0, tokens - p.knee_tokens)
            + p.per_kv_token_s * batch.kv_tokens_read
            + p.per_attn_pair_s * batch.prefill_attn_pairs
        )


@dataclass(frozen=True, slots=True)
class Efficiency:
    """How far below the datasheet a real engine runs; the priors' only tunable guesses.

    ``compute``: fraction of peak FLOP/s reached by large GEMMs (prefill MFU), 0-1; the default
    follows Vidur's per-layer GPU timings in ``config/profiles`` (why: docs/tenants.md).
    ``memory``: fraction of peak bandwidth reached by weight and KV reads, 0-1.
    ``step_overhead_s``: per-step launch, scheduling and sampling time not hidden by the GPU.
    ``per_decode_seq_s``: per-sequence CPU cost in a step (sampling, detokenising, bookkeeping).
    ``allreduce_latency_s``: one tensor-parallel all-reduce; two per layer when TP > 1.
    """

    compute: float = 0.7
    memory: float = 0.8
    step_overhead_s: float = 1.0e-3
    per_decode_seq_s: float = 5.0e-6
    allreduce_latency_s: float = 15.0e-6

    def __post_init__(self) -> None:
        if not (0.0 < self.compute <= 1.0 and 0.0 < self.memory <= 1.0):
            raise ValueError(f"efficiencies must be in (0, 1]: compute={self.compute}, memory={self.memory}")
        if min(self.step_overhead_s, self.per_decode_seq_s, self.allreduce_latency_s) < 0.0:
            raise ValueError("overheads must be >= 0")


#: The datasheet roofline with nothing lost: for hand-checked numbers.
IDEAL: Final = Efficiency(
    compute=1.0, memory=1.0, step_overhead_s=0.0, per_decode_seq_s=0.0, allreduce_latency_s=0.0
)


@dataclass(frozen=True, slots=True)
class RooflineTerms:
    """The prior's ingredients, for dashboards and hand checks (seconds and tokens).

    ``weight_read_s``: one read of all weights at effective bandwidth (the flat GEMM floor).
    ``compute_s_per_token``: 2P / F_eff. ``kv_s_per_token``: KV bytes per token / BW_eff.
    ``attn_s_per_pair``: 4 L d_attn / F_eff. ``overhead_s``: fixed per-step costs incl. all-reduces.
    ``knee_tokens``: weight_read_s / compute_s_per_token.
    """

    weight_read_s: float
    compute_s_per_token: float
    kv_s_per_token: float
    attn_s_per_pair: float
    overhead_s: float
    knee_tokens: float
    bandwidth_eff: float
    flops_eff: float


def roofline_terms(
    model: ModelArch, gpu: GpuSpec, *, tensor_parallel: int = 1, efficiency: Efficiency = Efficiency()
) -> RooflineTerms:
    """Roofline ingredients for ``model`` sharded over ``tensor_parallel`` devices of kind ``gpu``.

    Tensor parallelism multiplies aggregate bandwidth and FLOP/s (each rank reads and computes its
    shard) and adds two all-reduces per layer. ``gpu`` must be ``known``.
    """
    if not gpu.known:
        raise ValueError(f"no roofline for unknown hardware {gpu.name!r}")
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    bw = tensor_parallel * gpu.hbm_bandwidth * efficiency.memory
    flops = tensor_parallel * gpu.peak_flops(model.dtype_bytes) * efficiency.compute
    weight_read = model.weight_bytes / bw
    compute = model.linear_flops_per_token / flops
    allreduce = 2 * model.num_layers * efficiency.allreduce_latency_s if tensor_parallel > 1 else 0.0
    return RooflineTerms(
        weight_read_s=weight_read,
        compute_s_per_token=compute,
        kv_s_per_token=model.kv_bytes_per_token / bw,
        attn_s_per_pair=model.attention_flops_per_pair / flops,
        overhead_s=efficiency.step_overhead_s + allreduce,
        knee_tokens=weight_read / compute,
        bandwidth_eff=bw,
        flops_eff=flops,
    )


def unknown_step_model(reason: str, *, model: ModelArch | None = None) -> StepModel:
    """A not-yet-valid model: no knee (``UNKNOWN_KNEE_TOKENS``), alpha from ``model`` when known,
    coefficients zero."""
    alpha = model.attention_flops_per_pair / model.linear_flops_per_token if model else 0.0
    params = StepParams(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, UNKNOWN_KNEE_TOKENS, alpha)
    return StepModel(params, ModelSource.NONE, valid=False, reason=reason)


def roofline_prior(
    model: ModelArch | None,
    gpu: GpuSpec | None,
    *,
    tensor_parallel: int = 1,
    efficiency: Efficiency = Efficiency(),
) -> StepModel:
    """The step model hardware and model facts alone predict (valid when both are known).

    Unknown model or hardware gives ``valid=False`` with the reason; calibration then learns the
    coefficients from observations alone.
    """
    if model is None:
        return unknown_step_model("unknown model: no roofline prior")
    if gpu is None or not gpu.known:
        return unknown_step_model("unknown hardware: no roofline prior", model=model)
    r = roofline_terms(model, gpu, tensor_parallel=tensor_parallel, efficiency=efficiency)
    params = StepParams(
        base_s=r.overhead_s + r.weight_read_s,
        per_token_s=0.0,
        per_decode_seq_s=efficiency.per_decode_seq_s,
        per_compute_token_s=r.compute_s_per_token,
        per_kv_token_s=r.kv_s_per_token,
        per_attn_pair_s=r.attn_s_per_pair,
        knee_tokens=r.knee_tokens,
        attn_pair_tokens=r.attn_s_per_pair / r.compute_s_per_token,
    )
    return StepModel(params, ModelSource.PRIOR)
