"""What a tenant's token budget counts (``limits.token_weights``): plain tokens by default, fixed
weights, or the GPU-time opt-in whose weights move at a bounded pace (``gateway.tenants.pricing``).
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.admission.budget import request_cost
from gateway.admission.fairness import TokenWeights
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.limits.config import (
    GpuTimeWeightSettings,
    LimitsSettings,
    TenantLimitSettings,
    TokenWeightSettings,
)
from gateway.observability.metrics import METRICS
from gateway.observability.outcome import access_fields
from gateway.prediction.facts import ReplicaFacts
from gateway.prediction.service import PredictionService
from gateway.proxy.relay import _stream_over_budget
from gateway.replicas.config import HardwareSettings, ReplicaSettings
from gateway.tenants.live import Tenancy
from gateway.tenants.pricing import (
    DEFAULT_WEIGHTS,
    PLAIN_WEIGHTS,
    GpuTimeWeights,
    configured_weights,
    reference_prices,
)
from predictor import StepModel
from tests.unit.limits.fakes import FakeClock
from tests.unit.tenancy.conftest import Scripted, StartTenantGateway, fitted_step_model, tenancy_settings

H100 = ReplicaFacts(gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=256, max_num_batched_tokens=8192)
REPLICA = ReplicaSettings(
    name="r1", url="http://127.0.0.1:1", hardware=HardwareSettings(gpu="H100-SXM", model="Llama-3-8B")
)


class JumpingPredictions(PredictionService):
    """A prediction service whose step model for every replica is ``model``, set by the test."""

    def __init__(self, model: StepModel | None) -> None:
        super().__init__()
        self.model = model

    def step_model(self, replica: str) -> StepModel | None:
        return self.model


def _tenancy(limits: dict[str, Any], predictions: PredictionService, clock: FakeClock) -> Tenancy:
    """A tenancy whose one replica group, ``REPLICA``, serves the model ``m``."""
    settings = Settings(replicas=[REPLICA], limits=LimitsSettings.model_validate(limits))
    return Tenancy(SettingsStore(settings), predictions, clock=clock, groups=lambda: {"m": [REPLICA]})


def test_null_means_plain_tokens() -> None:
    limits = LimitsSettings()

    assert limits.token_weights is None
    assert configured_weights(limits) == PLAIN_WEIGHTS == TokenWeights(input=1.0, output=1.0)
    # The brief's worked example: 1,000 prompt + 200 predicted output tokens reserve 1,200.
    assert request_cost(PLAIN_WEIGHTS, 1000, 200) == 1200.0


def test_fixed_weights_keep_working() -> None:
    limits = LimitsSettings.model_validate({"token_weights": {"prompt": 1.0, "output": 2.5}})

    assert limits.token_weights == TokenWeightSettings(prompt=1.0, output=2.5)
    assert configured_weights(limits) == TokenWeights(input=1.0, output=2.5)


def test_gpu_time_is_an_explicit_mode_with_stated_defaults() -> None:
    limits = LimitsSettings.model_validate({"token_weights": {"mode": "gpu_time"}})

    assert limits.token_weights == GpuTimeWeightSettings(
        mode="gpu_time", reference_batch_seqs=64, reference_context_tokens=1024, max_change_per_minute=0.1
    )
    assert configured_weights(limits) is None


@pytest.mark.parametrize(
    "value",
    [
        {"mode": "gpu"},
        {"mode": "gpu_time", "prompt": 1.0},
        {"mode": "gpu_time", "max_change_per_minute": 0.0},
        {"mode": "gpu_time", "reference_batch_seqs": 0},
        {"prompt": 1.0},
        {"prompt": 0.0, "output": 1.0},
    ],
)
def test_bad_weights_are_refused(value: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        LimitsSettings.model_validate({"token_weights": value})


def test_tenancy_prices_plain_tokens_by_default() -> None:
    tenancy = _tenancy({}, JumpingPredictions(fitted_step_model(50e-6)), FakeClock())

    assert tenancy.weights() == PLAIN_WEIGHTS
    assert not tenancy.weighted


def test_reference_prices_ignore_the_live_batch() -> None:
    """The reference point is the configuration's, so the same step model gives the same price
    whatever the replica runs; a larger reference batch makes decode tokens cheaper."""
    model = H100.prior()
    small = reference_prices(REPLICA, model, GpuTimeWeightSettings(mode="gpu_time", reference_batch_seqs=8))
    large = reference_prices(REPLICA, model, GpuTimeWeightSettings(mode="gpu_time", reference_batch_seqs=256))

    assert small is not None
    assert large is not None
    assert small.ratio > large.ratio > 0.0


def test_gpu_time_weights_move_at_most_the_stated_pace() -> None:
    weights = GpuTimeWeights(GpuTimeWeightSettings(mode="gpu_time", max_change_per_minute=0.1), now=0.0)

    assert weights.current == DEFAULT_WEIGHTS
    assert weights.update(10.0, 1.0).output == 10.0  # the first price replaces the placeholder
    assert weights.update(1000.0, 61.0).output == pytest.approx(11.0, abs=0.01)
    assert weights.update(0.1, 121.0).output == pytest.approx(10.0, abs=0.01)
    assert weights.update(None, 181.0).output == pytest.approx(10.0, abs=0.01)
    assert weights.update(10.5, 30_000.0).output == 10.5  # reached: no overshoot


def test_identical_requests_in_a_minute_differ_by_at_most_the_stated_factor() -> None:
    """Virtual time: the step model's decode cost jumps 100x up, then down, every 7 s for 10
    minutes; two identical requests (1,000 prompt + 200 output tokens) priced within any 60 s
    never differ by more than ``1 + max_change_per_minute`` (give or take the 0.01 rounding)."""
    cheap, dear = fitted_step_model(50e-6), fitted_step_model(5e-3)
    predictions = JumpingPredictions(cheap)
    clock = FakeClock()
    tenancy = _tenancy({"token_weights": {"mode": "gpu_time"}}, predictions, clock)
    costs: list[tuple[float, float]] = []
    for second in range(600):
        predictions.model = dear if (second // 7) % 2 else cheap
        clock.now = float(second)
        costs.append((clock.now, request_cost(tenancy.weights("m"), 1000, 200)))

    assert tenancy.weighted
    worst = max(max(a, b) / min(a, b) for t0, a in costs for t1, b in costs if t0 <= t1 < t0 + 60.0)
    assert 1.0 < worst <= 1.1 + 200 * 0.005 / 1200


def test_stopped_stream_names_the_budget_unit() -> None:
    plain = _stream_over_budget(12, "team-a", "tokens")
    weighted = _stream_over_budget(12, "team-a", "weighted tokens")

    assert "on tokens per min (TPM)" in plain.message
    assert "on weighted tokens per min (TPM)" in weighted.message


def _plain(url: str) -> Settings:
    """The tenancy test gateway with the default ``limits:`` (plain tokens)."""
    return tenancy_settings(url).model_copy(update={"limits": LimitsSettings()})


@pytest.mark.parametrize(
    ("settings", "output"), [(_plain, 1.0), (tenancy_settings, 2.0)], ids=["plain", "fixed"]
)
async def test_the_weights_in_force_are_visible(
    start_tenant_gateway: StartTenantGateway, settings: Any, output: float
) -> None:
    """``/sluice/v1/tenants``, the ``sluice_token_weight`` gauge and the access line show the
    weights a request was charged at."""
    gw = await start_tenant_gateway(Scripted().answer, settings=settings)
    resp = await gw.post()
    assert resp.status == 200, await resp.text()
    listed = await (await gw.client.get("/sluice/v1/tenants")).json()
    scraped = gw.app[METRICS].exposition()[0].decode()
    line = access_fields(gw.outcomes[-1])

    assert (listed["token_weights"]["input"], listed["token_weights"]["output"]) == (1.0, output)
    assert 'sluice_token_weight{token="prompt"} 1.0' in scraped
    assert f'sluice_token_weight{{token="output"}} {output}' in scraped
    assert (line["tenant"], line["prompt_weight"], line["output_weight"]) == ("team-a", 1.0, output)


def _plain_and_tiny(url: str) -> Settings:
    """Plain tokens, and a token bucket no request fits in."""
    tiny = TenantLimitSettings(tokens_per_minute=600.0, token_burst=2.0)
    return tenancy_settings(url, limits=tiny).model_copy(update={"limits": LimitsSettings()})


async def test_a_plain_budget_refuses_in_tokens(start_tenant_gateway: StartTenantGateway) -> None:
    gw = await start_tenant_gateway(Scripted().answer, settings=_plain_and_tiny)
    resp = await gw.post()
    body = await resp.json()

    assert resp.status == 429
    assert "for tenant team-a on tokens per min (TPM)" in body["error"]["message"]
