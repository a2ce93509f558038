"""Cost model: realism anchors against Vidur's measured data, roofline terms, monotonicity, jitter."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.costmodel import CostModel, StepShape, jitter_factor, step_time_s
from simulator.profile import load_profile
from tests.unit.simulator.vidur_data import PROFILE_SOURCES, layer_ms

SHIPPED = sorted(PROFILE_SOURCES)


@pytest.fixture(scope="module")
def h100_8b() -> CostModel:
    return CostModel(load_profile("llama3-8b-h100"))


def _prefill(tokens: int) -> StepShape:
    return StepShape(prefill_chunks=((tokens, 0),))


# ----------------------------------------------------------------- realism anchors


def test_batch1_decode_matches_measured_layers(h100_8b: CostModel) -> None:
    """One stream on H100: 32 measured layers + overhead, within 20 %; about 6-7 ms, ~150 tok/s."""
    profile = h100_8b.profile
    measured_layer_ms = layer_ms("h100_Llama-2-7b-hf_mlp.csv", 1)[1]
    implied_s = profile.model.num_layers * measured_layer_ms / 1e3 + profile.cost.per_step_overhead_s
    modelled_s = h100_8b.step_time_s(StepShape(decode_contexts=(200,)))
    assert modelled_s == pytest.approx(implied_s, rel=0.20)
    assert 0.0055 <= modelled_s <= 0.0075
    assert 130 <= 1 / modelled_s <= 180


@pytest.mark.parametrize(
    ("name", "bound"),
    [
        pytest.param("llama3-8b-h100", 1.15, id="h100-8b"),
        pytest.param("llama2-70b-h100-tp4", 1.15, id="h100-70b-tp4"),
        # The A100 8B table itself rises 16 % from 1 to 64 tokens (0.303 -> 0.351 ms).
        pytest.param("llama3-8b-a100", 1.20, id="a100-8b"),
    ],
)
def test_flat_below_the_knee(name: str, bound: float) -> None:
    """Weight reads dominate small steps: 64 tokens cost barely more than 1, in the data and the model."""
    model = CostModel(load_profile(name))
    csv_name, tp = PROFILE_SOURCES[name]
    measured = layer_ms(csv_name, tp)
    modelled_ratio = model.step_time_s(_prefill(64)) / model.step_time_s(_prefill(1))
    assert measured[64] / measured[1] < bound
    assert modelled_ratio < bound
    assert modelled_ratio == pytest.approx(measured[64] / measured[1], rel=0.05)


@pytest.mark.parametrize("name", SHIPPED)
def test_linear_above_the_knee(name: str) -> None:
    """Compute-bound steps: doubling 2048 -> 4096 tokens about doubles the time, as measured."""
    model = CostModel(load_profile(name))
    csv_name, tp = PROFILE_SOURCES[name]
    measured = layer_ms(csv_name, tp)
    measured_ratio = measured[4096] / measured[2048]
    modelled_ratio = model.step_time_s(_prefill(4096)) / model.step_time_s(_prefill(2048))
    assert modelled_ratio == pytest.approx(2.0, rel=0.15)
    assert modelled_ratio == pytest.approx(measured_ratio, rel=0.10)


@pytest.mark.parametrize("name", SHIPPED)
def test_linear_part_follows_the_table_point_by_point(name: str) -> None:
    profile = load_profile(name)
    model = CostModel(profile)
    csv_name, tp = PROFILE_SOURCES[name]
    for n in (1, 128, 512, 1024, 2048, 4096):
        expected_s = layer_ms(csv_name, tp)[n] * profile.cost.linear_scale / 1e3
        assert model.linear_layer_s(n) == pytest.approx(expected_s, rel=1e-4), n


def test_extrapolates_linearly_past_the_table(h100_8b: CostModel) -> None:
    assert max(h100_8b.profile.cost.linear_ms_per_layer) == 4096
    assert h100_8b.linear_s(8192) / h100_8b.linear_s(4096) == pytest.approx(2.0, rel=0.10)


def test_interpolates_between_points(h100_8b: CostModel) -> None:
    low, high = h100_8b.linear_layer_s(2048), h100_8b.linear_layer_s(2080)
    assert low < h100_8b.linear_layer_s(2064) < high


# ----------------------------------------------------------------- roofline terms


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("llama3-8b-h100", False, id="tp1-no-allreduce"),
        pytest.param("llama2-70b-h100-tp4", True, id="tp4-allreduce"),
    ],
)
def test_allreduce_only_under_tensor_parallelism(name: str, expected: bool) -> None:
    assert (CostModel(load_profile(name)).allreduce_s(128) > 0) is expected


def test_decode_attention_is_kv_bytes_over_bandwidth(h100_8b: CostModel) -> None:
    profile = h100_8b.profile
    bandwidth = profile.gpu.hbm_bandwidth_Bps * profile.cost.hbm_efficiency
    contexts = (1000, 3000)
    assert h100_8b.decode_attention_s(contexts) == pytest.approx(4000 * 131072 / bandwidth)


def test_prefill_attention_is_quadratic_in_the_chunk(h100_8b: CostModel) -> None:
    one = h100_8b.prefill_attention_s(((4096, 0),))
    two = h100_8b.prefill_attention_s(((8192, 0),))
    assert two / one == pytest.approx(4.0, rel=0.01)


def test_short_chunk_on_long_context_is_bound_by_kv_reads(h100_8b: CostModel) -> None:
    profile = h100_8b.profile
    bandwidth = profile.gpu.hbm_bandwidth_Bps * profile.cost.hbm_efficiency
    assert h100_8b.prefill_attention_s(((8, 6000),)) == pytest.approx(6008 * 131072 / bandwidth)


def test_lm_head_memory_bound_then_compute_bound(h100_8b: CostModel) -> None:
    assert h100_8b.lm_head_s(1) == h100_8b.lm_head_s(64)
    assert h100_8b.lm_head_s(4096) > h100_8b.lm_head_s(64)


def test_empty_step_costs_nothing(h100_8b: CostModel) -> None:
    assert h100_8b.step_time_s(StepShape()) == 0.0


def test_module_function_equals_method(h100_8b: CostModel) -> None:
    shape = StepShape(prefill_chunks=((300, 100),), decode_contexts=(50, 60))
    assert step_time_s(h100_8b.profile, shape) == h100_8b.step_time_s(shape)


@pytest.mark.parametrize(
    ("lighter", "heavier"),
    [
        pytest.param(
            StepShape(decode_contexts=(500,) * 8), StepShape(decode_contexts=(500,) * 64), id="more-decodes"
        ),
        pytest.param(
            StepShape(decode_contexts=(500,) * 8), StepShape(decode_contexts=(4000,) * 8), id="longer-context"
        ),
        pytest.param(_prefill(256), _prefill(2048), id="longer-prefill"),
        pytest.param(
            StepShape(decode_contexts=(500,) * 8),
            StepShape(prefill_chunks=((512, 0),), decode_contexts=(500,) * 8),
            id="decodes-plus-chunk",
        ),
        pytest.param(_prefill(512), StepShape(prefill_chunks=((512, 3000),)), id="chunk-on-context"),
    ],
)
def test_step_time_grows_with_load(h100_8b: CostModel, lighter: StepShape, heavier: StepShape) -> None:
    assert h100_8b.step_time_s(heavier) > h100_8b.step_time_s(lighter)


@pytest.mark.parametrize("name", SHIPPED)
def test_doubling_the_tokens_never_makes_a_step_cheaper(name: str) -> None:
    """Below the knee the measured medians wiggle by a few % (1 token: 0.175 ms, 2: 0.171 ms on H100)."""
    model = CostModel(load_profile(name))
    for n in range(1, 4097, 3):
        single, double = model.step_time_s(_prefill(n)), model.step_time_s(_prefill(2 * n))
        assert double > (single if n >= 256 else 0.95 * single), n


def test_step_shape_counts() -> None:
    shape = StepShape(prefill_chunks=((100, 20), (30, 0)), decode_contexts=(7, 9, 11))
    assert (shape.num_prefill_tokens, shape.num_decode_seqs, shape.num_tokens, shape.num_seqs) == (
        130,
        3,
        133,
        5,
    )
    assert shape.num_kv_tokens_read == 120 + 30 + 27


# ----------------------------------------------------------------- jitter


def test_zero_jitter_is_exactly_one_and_draws_nothing() -> None:
    rng = np.random.default_rng(7)
    state = rng.bit_generator.state
    assert jitter_factor(rng, 0.0) == 1.0
    assert rng.bit_generator.state == state


def test_jitter_has_mean_one_and_the_requested_spread() -> None:
    rng = np.random.default_rng(11)
    draws = np.array([jitter_factor(rng, 0.1) for _ in range(20_000)])
    assert draws.mean() == pytest.approx(1.0, abs=0.005)
    assert draws.std() == pytest.approx(0.1, rel=0.05)
    assert draws.min() > 0


# ----------------------------------------------------------------- a fitted step model


def test_a_profile_with_a_step_model_prices_steps_with_it() -> None:
    """``step_model`` replaces the table: hand-worked, a 200-token chunk and 10 decodes at 1000
    tokens of context is 210 tokens: 1 ms + 100 x 10 us + 110 x 20 us + 10 x 1 us
    + 10,000 x 0.01 us + (200 x 100 pairs) x 1 ns = 4.33 ms."""
    base = load_profile("llama3-8b-h100")
    fitted = base.model_validate(
        {
            **base.model_dump(),
            "step_model": {
                "base_s": 1e-3,
                "per_token_s": 1e-5,
                "per_decode_seq_s": 1e-6,
                "per_compute_token_s": 2e-5,
                "per_kv_token_s": 1e-8,
                "per_attn_pair_s": 1e-9,
                "knee_tokens": 100,
            },
        }
    )
    shape = StepShape(prefill_chunks=((200, 0),), decode_contexts=(1000,) * 10)
    assert step_time_s(fitted, shape) == pytest.approx(4.33e-3)
    assert step_time_s(fitted, StepShape()) == 0.0
    assert step_time_s(base, shape) != pytest.approx(4.33e-3)
