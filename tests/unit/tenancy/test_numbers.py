"""The pure parts of tenancy: durations, headers, token weights (``gateway.tenants.pricing``),
what a request costs (``gateway.admission.budget``). What a finished request is charged is the
engine's (``tests/unit/admission/test_engine_budget.py``)."""

from __future__ import annotations

import math
import random

import pytest

from gateway.admission.budget import BudgetRefused, budget_retry_after, request_cost
from gateway.admission.config import RetryAfterSettings
from gateway.admission.fairness import TokenWeights
from gateway.admission.live_budget import is_unlimited, over_budget
from gateway.http.rate_limit_headers import go_duration, rate_limit_headers
from gateway.limits.base import TenantLimits
from gateway.limits.memory import MemoryLimiter
from gateway.observability.outcome import RequestOutcome
from gateway.prediction.facts import ReplicaFacts
from gateway.prediction.service import PredictionService
from gateway.replicas.config import HardwareSettings, ReplicaSettings
from gateway.replicas.snapshot import ReplicaSnapshot
from gateway.tenants.live import is_admin_path
from gateway.tenants.pricing import (
    DEFAULT_WEIGHTS,
    TokenPrices,
    decode_to_prefill_ratio,
    fleet_token_weights,
    replica_prices,
    split_context,
    step_model_prices,
)
from predictor import StepModel, StepParams
from tests.unit.limits.fakes import FakeClock


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        pytest.param(0.0, "0s", id="zero"),
        pytest.param(-1.0, "0s", id="negative"),
        pytest.param(math.inf, "0s", id="infinite"),
        pytest.param(0.0004, "1ms", id="rounds-up-to-a-millisecond"),
        pytest.param(0.02, "20ms", id="milliseconds"),
        pytest.param(1.0, "1s", id="one-second"),
        pytest.param(1.5, "1.5s", id="fraction"),
        pytest.param(12.345, "12.345s", id="three-decimals"),
        pytest.param(360.0, "6m0s", id="minutes-as-openai"),
        pytest.param(3723.5, "1h2m3.5s", id="hours"),
        pytest.param(3600.0, "1h0m0s", id="one-hour"),
    ],
)
def test_go_duration(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


LIMITS = TenantLimits(
    tokens_per_minute=600.0, token_burst=100.0, requests_per_minute=60.0, request_burst=10.0
)


def _limiter() -> MemoryLimiter:
    return MemoryLimiter(clock=FakeClock())


def test_rate_limit_headers_of_an_allowed_reservation() -> None:
    reservation = _limiter().reserve_now("t", cost_tokens=30.5, limits=LIMITS, request_id="a")

    assert rate_limit_headers(reservation) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "69",  # 69.5 left: whole tokens only
        "x-ratelimit-reset-tokens": "3.05s",
    }


def test_rate_limit_headers_never_show_a_debt() -> None:
    limiter = _limiter()
    first = limiter.reserve_now("t", cost_tokens=100.0, limits=LIMITS, request_id="a")
    limiter.settle_now(first, actual_cost_tokens=150.0)  # 50 tokens of debt

    refused = limiter.reserve_now("t", cost_tokens=10.0, limits=LIMITS, request_id="b")

    assert not refused.allowed
    headers = rate_limit_headers(refused)
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-reset-tokens"] == "15s"  # 150 tokens short at 10 per second
    retry = budget_retry_after(refused, 0.0, RetryAfterSettings(), random.Random(0))
    error = over_budget(BudgetRefused("t", refused, retry), _outcome())
    # 60 short of 10 a second: 6 s, jittered up to half as much again.
    assert 6 <= int(error.headers()["Retry-After"]) <= 9


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        pytest.param(TenantLimits(), {}, id="unlimited"),
        pytest.param(
            TenantLimits(requests_per_minute=30.0),
            {
                "x-ratelimit-limit-requests": "30",
                "x-ratelimit-remaining-requests": "29",
                "x-ratelimit-reset-requests": "2s",
            },
            id="requests-only",
        ),
        pytest.param(TenantLimits(max_concurrent=3), {}, id="concurrency-only"),
    ],
)
def test_rate_limit_headers_name_only_limited_budgets(limits: TenantLimits, expected: dict[str, str]) -> None:
    reservation = _limiter().reserve_now("t", cost_tokens=5.0, limits=limits, request_id="a")

    assert rate_limit_headers(reservation) == expected


@pytest.mark.parametrize(
    ("limits", "unlimited"),
    [
        pytest.param(TenantLimits(), True, id="nothing"),
        pytest.param(TenantLimits(max_concurrent=1), False, id="concurrency"),
        pytest.param(TenantLimits(tokens_per_minute=1.0), False, id="tokens"),
        pytest.param(TenantLimits(requests_per_minute=1.0), False, id="requests"),
    ],
)
def test_is_unlimited(limits: TenantLimits, unlimited: bool) -> None:
    assert is_unlimited(limits) is unlimited


@pytest.mark.parametrize(
    ("path", "admin"),
    [
        ("/metrics", True),
        ("/metrics/replicas", True),
        ("/sluice/v1/replicas", True),
        ("/sluice/v1", True),
        ("/metricsx", False),
        ("/v1/models", False),
        ("/v1/chat/completions", False),
        ("/healthz", False),
    ],
)
def test_is_admin_path(path: str, admin: bool) -> None:
    assert is_admin_path(path) is admin


# -- token weights -----------------------------------------------------------------------------------

H100 = ReplicaFacts(gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=256, max_num_batched_tokens=8192)


def test_decode_costs_more_gpu_time_than_prefill_per_token() -> None:
    """Roofline: a prefill token is compute bound (2P FLOPs), a decode token at batch 256 also
    pays its share of the weight read and its KV reads; the ratio lands near VTC's 1 : 2."""
    ratio = decode_to_prefill_ratio(H100.prior(), max_num_batched_tokens=8192, max_num_seqs=256)

    assert ratio is not None
    assert 1.5 < ratio < 4.0


def test_small_batches_make_decode_tokens_dearer() -> None:
    model = H100.prior()
    busy = decode_to_prefill_ratio(model, max_num_batched_tokens=8192, max_num_seqs=256)
    small = decode_to_prefill_ratio(model, max_num_batched_tokens=8192, max_num_seqs=16)

    assert busy is not None
    assert small is not None
    assert small > busy


def test_unknown_hardware_has_no_ratio() -> None:
    model = ReplicaFacts(gpu=None, model=None).prior()

    assert decode_to_prefill_ratio(model, max_num_batched_tokens=8192, max_num_seqs=256) is None


def _replica(name: str, gpu: str | None) -> ReplicaSettings:
    hardware = HardwareSettings(gpu=gpu, model="Llama-3-8B" if gpu else None)
    return ReplicaSettings(name=name, url="http://127.0.0.1:1", hardware=hardware)


def test_fleet_weights_average_the_replicas_with_a_model() -> None:
    service = PredictionService()
    service.set_replica("known", H100)
    service.set_replica("unknown", ReplicaFacts())
    replicas = [_replica("known", "H100-SXM"), _replica("unknown", None), _replica("absent", None)]
    ratio = decode_to_prefill_ratio(H100.prior(), max_num_batched_tokens=8192, max_num_seqs=256)

    weights = fleet_token_weights(service, replicas)

    assert ratio is not None
    assert weights == TokenWeights(input=1.0, output=round(ratio, 2))


def test_fleet_weights_default_without_any_model() -> None:
    service = PredictionService()
    service.set_replica("unknown", ReplicaFacts())

    assert (
        fleet_token_weights(service, [_replica("unknown", None)]) == DEFAULT_WEIGHTS == TokenWeights(1.0, 2.0)
    )


#: A fitted-looking model: 10 ms per step whatever it carries, 20 us per token past a 200-token
#: knee, 50 us per decoding sequence, 0.1 us per KV token read; no attention term.
LINEAR = StepModel(
    StepParams(
        base_s=0.010,
        per_token_s=0.0,
        per_decode_seq_s=50e-6,
        per_compute_token_s=20e-6,
        per_kv_token_s=0.1e-6,
        knee_tokens=200.0,
    )
)


def test_prices_at_the_observed_batch() -> None:
    """Decode: the batch's step per sequence; prefill: what a full chunk adds to that step."""
    prices = step_model_prices(
        LINEAR, max_num_batched_tokens=8192, max_num_seqs=256, decode_seqs=10.0, context_tokens=500.0
    )

    assert prices is not None
    assert prices.decode_s == pytest.approx((0.010 + 10 * 50e-6 + 10 * 500 * 0.1e-6) / 10)
    # 10 decodes sit below the knee: the chunk's tokens past it are 8192 + 10 - 200.
    assert prices.prefill_s == pytest.approx(20e-6 * (8192 + 10 - 200) / 8192)
    assert prices.ratio == prices.decode_s / prices.prefill_s


def test_a_degenerate_prefill_fit_does_not_make_prompts_free() -> None:
    """A fit with no per-token prefill cost yet: a full chunk still costs one decode step more."""
    flat = StepModel(
        StepParams(
            base_s=0.010,
            per_token_s=0.0,
            per_decode_seq_s=50e-6,
            per_compute_token_s=0.0,
            per_kv_token_s=0.1e-6,
            knee_tokens=200.0,
        )
    )
    prices = step_model_prices(
        flat, max_num_batched_tokens=8192, max_num_seqs=4, decode_seqs=4.0, context_tokens=500.0
    )

    assert prices is not None
    step = 0.010 + 4 * 50e-6 + 4 * 500 * 0.1e-6
    assert prices.prefill_s == pytest.approx(step / 8192)
    assert prices.ratio == pytest.approx(8192 / 4)


def test_smaller_observed_batches_make_decode_tokens_dearer() -> None:
    def ratio(seqs: float) -> float:
        value = decode_to_prefill_ratio(
            LINEAR, max_num_batched_tokens=8192, max_num_seqs=64, decode_seqs=seqs, context_tokens=500.0
        )
        assert value is not None
        return value

    assert ratio(4.0) > ratio(16.0) > ratio(64.0)
    # The batch is capped by the engine's max_num_seqs, and is at least one sequence.
    assert ratio(1000.0) == ratio(64.0)
    assert ratio(0.2) == ratio(1.0)


def test_replica_prices_use_the_batch_it_ran() -> None:
    service = PredictionService()
    service.set_replica("r0", H100)
    replica = _replica("r0", "H100-SXM")
    model = service.step_model("r0")
    assert model is not None
    settings = {"max_num_batched_tokens": 8192, "max_num_seqs": 256}
    # Before any scrape: the default batch (256 sequences at 1024 tokens of context).
    assert replica_prices(service, replica, model) == step_model_prices(model, **settings)

    # A busy window: 8 output tokens per step, 600 KV tokens per running request.
    for at in (8.0, 9.0, 10.0):
        service.on_snapshot(
            ReplicaSnapshot(
                name="r0",
                taken_at=at,
                metrics_at=at,
                window_s=5.0,
                num_running=12,
                num_waiting=0,
                kv_cache_usage=12 * 600 / 448_304,
                kv_capacity_tokens=448_304,
                prompt_tokens_per_s=7200.0,
                generation_tokens_per_s=720.0,
                steps_per_s=90.0,
            )
        )
    model = service.step_model("r0")
    assert model is not None
    prices = replica_prices(service, replica, model)

    assert prices is not None
    at_batch = step_model_prices(model, **settings, decode_seqs=8.0, context_tokens=600.0)
    assert at_batch is not None
    # The output token at that batch, split into its own part and its KV read per context token.
    assert prices.context_s == model.params.per_kv_token_s > 0.0
    assert prices.decode_s + 600.0 * prices.context_s == pytest.approx(at_batch.decode_s)
    assert prices.prefill_s == at_batch.prefill_s
    weights = fleet_token_weights(service, [replica])
    context = float(f"{prices.context_ratio:.3g}")
    assert weights == TokenWeights(input=1.0, output=round(prices.ratio, 2), context=context)


def test_split_context_keeps_the_mean_price_when_the_kv_price_is_not_borne_out() -> None:
    split = split_context(1.0e-3, 2.0e-7, 1000.0, 20.0e-6)
    assert split.decode_s == pytest.approx(0.8e-3)
    assert split.context_s == 2.0e-7
    # A KV part over half of the mean price: no split.
    assert split_context(1.0e-3, 1.0e-6, 1000.0, 20.0e-6) == TokenPrices(20.0e-6, 1.0e-3)


def _outcome() -> RequestOutcome:
    return RequestOutcome(request_id="r", method="POST", path="/v1/completions", received_at=0.0)


@pytest.mark.parametrize(
    ("weights", "prompt", "output", "choices", "cost"),
    [
        pytest.param(TokenWeights(1.0, 2.0), 100, 30, 1, 160.0, id="one-choice"),
        pytest.param(TokenWeights(1.0, 2.0), 100, 30, 3, 160.0, id="three-choices-no-context-weight"),
        # One sequence of 30 after 100: 30 x 100 + 30 x 29 / 2 = 3435 context tokens.
        pytest.param(TokenWeights(1.0, 2.0, context=0.01), 100, 30, 1, 160.0 + 34.35, id="context-one"),
        # Three of 10 after the same 100: 3 x (10 x 100 + 10 x 9 / 2) = 3135 (a shorter history each).
        pytest.param(TokenWeights(1.0, 2.0, context=0.01), 100, 30, 3, 160.0 + 31.35, id="context-three"),
    ],
)
def test_request_cost_splits_the_output_over_the_choices(
    weights: TokenWeights, prompt: int, output: int, choices: int, cost: float
) -> None:
    assert request_cost(weights, prompt, output, choices) == pytest.approx(cost)
