"""Step time from batch composition: the roofline prior's numbers and the hinge's shape."""

from __future__ import annotations

import math

import pytest

from predictor.hardware import GPUS, lookup_gpu
from predictor.model import MODELS
from predictor.step_model import (
    IDEAL,
    UNKNOWN_KNEE_TOKENS,
    Efficiency,
    ModelSource,
    StepBatch,
    StepModel,
    StepParams,
    roofline_prior,
    step_features,
)

IDEAL_8B_H100 = roofline_prior(MODELS["Llama-3-8B"], GPUS["H100-SXM"], efficiency=IDEAL)


# math.md §1.3 worked example: Llama-3-8B BF16 on H100, ideal roofline, no overheads.
@pytest.mark.parametrize(
    ("batch", "context", "expected_ms"),
    [
        (1, 1024, 4.79 + 1 * 1024 * 131072 / 3.35e12 * 1e3),
        (64, 1024, 7.36),  # weights 4.79 ms + KV 2.56 ms
        (256, 1024, 15.05),  # still below the ~295-token knee
        (256, 4096, 45.8),  # KV dominates: context, not batch size, drives TPOT
    ],
    ids=["batch1-1k", "batch64-1k", "batch256-1k", "batch256-4k"],
)
def test_ideal_decode_step_matches_worked_example(batch: int, context: int, expected_ms: float) -> None:
    t = IDEAL_8B_H100.step_time(StepBatch(decode_seqs=batch, kv_tokens_read=batch * context))
    assert t * 1e3 == pytest.approx(expected_ms, rel=0.01)


def test_ideal_prefill_of_2048_tokens_is_about_34_ms() -> None:
    # ~34 TFLOP at 989 TFLOP/s (math.md §1.3): linear 2P x 2048 plus causal attention.
    t = IDEAL_8B_H100.step_time(StepBatch(prefill_tokens=2048, prefill_attn_pairs=2048 * 2048 / 2))
    assert t * 1e3 == pytest.approx(34.4, rel=0.01)


@pytest.mark.parametrize(
    ("tokens_a", "tokens_b", "relation"),
    [
        (1, 200, "flat"),  # both below the knee: weight-read bound
        (400, 800, "linear"),  # both above: compute bound
    ],
    ids=["below-knee-flat", "above-knee-linear"],
)
def test_knee_shape(tokens_a: int, tokens_b: int, relation: str) -> None:
    ta = IDEAL_8B_H100.step_time(StepBatch(prefill_tokens=tokens_a))
    tb = IDEAL_8B_H100.step_time(StepBatch(prefill_tokens=tokens_b))
    if relation == "flat":
        assert tb == pytest.approx(ta)
    else:
        slope = IDEAL_8B_H100.params.per_compute_token_s
        assert tb - ta == pytest.approx(slope * (tokens_b - tokens_a))


def test_hinge_equals_roofline_max() -> None:
    p = IDEAL_8B_H100.params
    weight_read = p.base_s
    for tokens in (1, 100, 295, 296, 1000, 8192):
        roofline = max(weight_read, tokens * p.per_compute_token_s)
        assert IDEAL_8B_H100.step_time(StepBatch(prefill_tokens=tokens)) == pytest.approx(roofline, rel=1e-9)


def test_realistic_prior_is_slower_than_ideal_and_has_lower_knee() -> None:
    real = roofline_prior(MODELS["Llama-3-8B"], GPUS["H100-SXM"])
    batch = StepBatch(prefill_tokens=512, decode_seqs=32, kv_tokens_read=32 * 2048)
    assert real.step_time(batch) > IDEAL_8B_H100.step_time(batch)
    # knee = F_eff / BW_eff for 2-byte weights = 0.7 F / (0.8 BW)
    assert real.params.knee_tokens == pytest.approx(989.4 / 3.35 * 0.7 / 0.8, rel=1e-3)


@pytest.mark.parametrize(
    ("model", "gpu", "reason"),
    [
        (None, "H100-SXM", "unknown model"),
        ("Llama-3-8B", "cpu", "unknown hardware"),
        ("Llama-3-8B", None, "unknown hardware"),
    ],
    ids=["no-model", "cpu", "no-gpu"],
)
def test_prior_is_invalid_without_facts(model: str | None, gpu: str | None, reason: str) -> None:
    prior = roofline_prior(MODELS[model] if model else None, lookup_gpu(gpu) if gpu else None)
    assert not prior.valid
    assert prior.source == ModelSource.NONE
    assert prior.reason is not None
    assert reason in prior.reason
    assert math.isnan(prior.step_time(StepBatch(decode_seqs=1)))
    assert prior.params.knee_tokens == UNKNOWN_KNEE_TOKENS


def test_features_dot_coefficients_is_step_time() -> None:
    model = StepModel(StepParams(0.01, 1e-6, 2e-5, 3e-5, 4e-8, 3e-10, knee_tokens=100.0))
    batch = StepBatch(prefill_tokens=700, decode_seqs=20, kv_tokens_read=50_000, prefill_attn_pairs=1e6)
    x = step_features(batch, 100.0)
    dot = sum(a * b for a, b in zip(x, model.params.coefficients(), strict=True))
    assert dot == pytest.approx(model.step_time(batch))


def test_step_batch_rejects_negative_counts() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        StepBatch(decode_seqs=-1)


@pytest.mark.parametrize(
    "kwargs",
    [{"compute": 0.0}, {"memory": 1.5}, {"step_overhead_s": -1.0}],
    ids=["zero-mfu", "mbu-above-one", "negative-overhead"],
)
def test_efficiency_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        Efficiency(**kwargs)
