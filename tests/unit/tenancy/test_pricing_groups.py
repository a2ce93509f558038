"""GPU-time weights per replica group (``limits.token_weights: {mode: gpu_time}``): a request is
priced with the weights of the replicas serving its model, each group moving at its own bounded
pace, and a reservation is settled with the weights it was priced with
(``gateway.tenants.pricing.GroupWeights``, ``gateway.tenants.live.Tenancy.weights``). Virtual
time throughout (a fake clock)."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest

from gateway.admission.budget import BudgetAnswer, BudgetLedger, Hold, request_cost
from gateway.admission.fairness import TokenWeights
from gateway.admission.request import AdmissionRequest
from gateway.admission.results import Ending
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.limits.config import GpuTimeWeightSettings, LimitsSettings
from gateway.observability.metrics import METRICS
from gateway.observability.outcome import access_fields
from gateway.prediction.service import PredictionService
from gateway.replicas.config import HardwareSettings, ReplicaSettings
from gateway.tenants.live import Tenancy
from gateway.tenants.pricing import DEFAULT_WEIGHTS, reference_prices
from predictor import StepModel
from tests.unit.gateway.fakes import MODEL
from tests.unit.limits.fakes import FakeClock
from tests.unit.tenancy.conftest import Scripted, StartTenantGateway, fitted_step_model, tenancy_settings

SETTINGS = GpuTimeWeightSettings(mode="gpu_time")
H100 = ReplicaSettings(
    name="h100", url="http://127.0.0.1:1", hardware=HardwareSettings(gpu="H100-SXM", model="Llama-3-8B")
)
A100 = ReplicaSettings(
    name="a100", url="http://127.0.0.1:2", hardware=HardwareSettings(gpu="A100-80GB-SXM", model="Llama-3-8B")
)
SPARE = ReplicaSettings(name="spare", url="http://127.0.0.1:3")
#: Model A on the H100 replica, model B on the A100 one, model C on one without a step model.
GROUPS: dict[str, Sequence[ReplicaSettings]] = {"model-a": [H100], "model-b": [A100], "model-c": [SPARE]}


class PerReplicaPredictions(PredictionService):
    """A prediction service whose step model of each replica is ``models[name]`` (set by the
    test; a replica not listed has none)."""

    def __init__(self, models: Mapping[str, StepModel]) -> None:
        super().__init__()
        self.models = dict(models)

    def step_model(self, replica: str) -> StepModel | None:
        return self.models.get(replica)


def _tenancy(
    predictions: PredictionService, clock: FakeClock, groups: Mapping[str, Sequence[ReplicaSettings]] = GROUPS
) -> Tenancy:
    limits = LimitsSettings.model_validate({"token_weights": {"mode": "gpu_time"}})
    settings = Settings(replicas=[H100, A100, SPARE], limits=limits)
    return Tenancy(SettingsStore(settings), predictions, clock=clock, groups=lambda: groups)


def _ratio(replica: ReplicaSettings, model: StepModel) -> float:
    prices = reference_prices(replica, model, SETTINGS)
    assert prices is not None
    return round(prices.ratio, 2)


def test_two_models_on_two_replica_groups_get_their_own_output_weights() -> None:
    """Each model is priced from its own group's step model at the reference point, not from a
    blend of the fleet's: here the two groups' output weights differ by about 3x."""
    cheap, dear = fitted_step_model(50e-6), fitted_step_model(500e-6)
    tenancy = _tenancy(PerReplicaPredictions({"h100": cheap, "a100": dear}), FakeClock())

    a, b = tenancy.weights("model-a"), tenancy.weights("model-b")

    assert a == TokenWeights(input=1.0, output=_ratio(H100, cheap))
    assert b == TokenWeights(input=1.0, output=_ratio(A100, dear))
    assert b.output > 3 * a.output
    assert tenancy.weights_by_model() == {"model-a": a, "model-b": b, "model-c": DEFAULT_WEIGHTS}
    # Fair share's one set of weights: the mean over the groups served.
    fleet = round((a.output + b.output + DEFAULT_WEIGHTS.output) / 3, 2)
    assert tenancy.weights() == TokenWeights(input=1.0, output=fleet)


def test_a_replica_serving_two_models_prices_both_groups() -> None:
    model = fitted_step_model(200e-6)
    groups = {"model-a": [H100], "model-b": [H100, A100]}
    tenancy = _tenancy(PerReplicaPredictions({"h100": model}), FakeClock(), groups)

    # A100 has no step model: model-b's group is priced by the H100 alone, as model-a's.
    assert tenancy.weights("model-a") == tenancy.weights("model-b") == TokenWeights(1.0, _ratio(H100, model))


def test_a_model_with_no_valid_step_model_gets_the_default_weights() -> None:
    tenancy = _tenancy(PerReplicaPredictions({"h100": fitted_step_model(50e-6)}), FakeClock())

    assert tenancy.weights("model-c") == DEFAULT_WEIGHTS  # its replica has no step model
    assert tenancy.weights("no-such-model") == DEFAULT_WEIGHTS  # no replica serves it
    assert "no-such-model" not in tenancy.weights_by_model()  # a client's name is never kept


def test_each_group_moves_at_most_the_stated_pace_and_alone() -> None:
    """Model A's step model jumps 100x up and down every 7 s for 10 minutes; model B's stays.
    Model A's output weight never moves more than a factor 1.1 within any 60 s (give or take
    the 0.01 rounding); model B's never moves at all."""
    cheap, dear = fitted_step_model(50e-6), fitted_step_model(5e-3)
    predictions = PerReplicaPredictions({"h100": cheap, "a100": cheap})
    clock = FakeClock()
    tenancy = _tenancy(predictions, clock)
    seen: list[tuple[float, float, float]] = []
    for second in range(600):
        predictions.models["h100"] = dear if (second // 7) % 2 else cheap
        clock.now = 1000.0 + second
        seen.append((clock.now, tenancy.weights("model-a").output, tenancy.weights("model-b").output))

    worst = max(max(a, b) / min(a, b) for t0, a, _ in seen for t1, b, _ in seen if t0 <= t1 < t0 + 60.0)
    assert 1.0 < worst <= 1.1 + 0.01 / min(a for _, a, _ in seen)
    assert {b for _, _, b in seen} == {_ratio(A100, cheap)}


@dataclass(frozen=True)
class Answer:
    """An allowed budget answer (``BudgetAnswer``)."""

    tenant: str
    cost_tokens: float
    allowed: bool = True
    blocked_by: frozenset[str] = frozenset()
    oversize: bool = False
    retry_after_s: float | None = None


class TenancyBudget:
    """A ``TenantBudget`` priced by a ``Tenancy`` that takes everything and records settles."""

    def __init__(self, tenancy: Tenancy) -> None:
        self.tenancy = tenancy
        self.settled: list[float] = []

    def weights(self, model: str | None = None) -> TokenWeights:
        return self.tenancy.weights(model)

    def reserve(self, request: AdmissionRequest, cost_tokens: float, now: float) -> BudgetAnswer | None:
        assert request.tenant is not None
        return Answer(request.tenant, cost_tokens)

    def settle(self, answer: BudgetAnswer, actual_cost_tokens: float, now: float) -> None:
        self.settled.append(actual_cost_tokens)


def _request(model: str) -> AdmissionRequest:
    return AdmissionRequest(
        request_id="r-1",
        request_class="default",
        prompt_tokens=1000,
        max_tokens=200,
        expected_output_tokens=200.0,
        arrival_s=0.0,
        tenant="team-a",
        model=model,
    )


def test_a_reservation_is_settled_with_the_weights_of_its_model_it_was_priced_with() -> None:
    """Priced (``cost``) at model A's weights, then the weights move (a refresh 61 s later)
    before the engine takes the reservation: the hold keeps the weights its cost was priced
    with, and the settle charges at those, not at the ones in force, nor at model B's."""
    cheap, dear = fitted_step_model(50e-6), fitted_step_model(5e-3)
    predictions = PerReplicaPredictions({"h100": cheap, "a100": dear})
    clock = FakeClock()
    budget = TenancyBudget(_tenancy(predictions, clock))
    ledger = BudgetLedger(budget, logging.getLogger("test"), rng=random.Random(0))
    request = _request("model-a")
    priced_at = budget.weights("model-a")

    cost = ledger.cost(request)
    predictions.models["h100"] = dear
    clock.advance(61.0)
    assert budget.weights("model-a").output > priced_at.output  # moved meanwhile
    hold = ledger.reserve(request, clock.now)

    assert isinstance(hold, Hold)
    assert hold.weights == priced_at != budget.weights("model-b")
    assert cost == hold.answer.cost_tokens == request_cost(priced_at, 1000, 200)
    ledger.settle(hold, Ending(produced_tokens=150, prompt_tokens=1000), 150, clock.now)
    assert budget.settled == [pytest.approx(1000 + priced_at.output * 150)]


def _gpu_time(url: str) -> Settings:
    """The tenancy test gateway with GPU-time weights; its replica (an H100) serves ``MODEL``."""
    settings = tenancy_settings(url)
    replicas = [r.model_copy(update={"hardware": H100.hardware}) for r in settings.replicas]
    limits = LimitsSettings.model_validate({"token_weights": {"mode": "gpu_time"}})
    return settings.model_copy(update={"replicas": replicas, "limits": limits})


async def test_the_groups_weights_in_force_are_visible(start_tenant_gateway: StartTenantGateway) -> None:
    """``/sluice/v1/tenants``, ``sluice_model_token_weight{model}`` and the access line show the
    weights of the request's model's replica group (the registry's replicas serving it)."""
    gw = await start_tenant_gateway(Scripted().answer, settings=_gpu_time)
    resp = await gw.post()
    assert resp.status == 200, await resp.text()
    listed = await (await gw.client.get("/sluice/v1/tenants")).json()
    scraped = gw.app[METRICS].exposition()[0].decode()
    line = access_fields(gw.outcomes[-1])
    output = gw.tenancy.weights(MODEL).output

    assert output == 7.14  # the H100 prior's w_out at the reference point (docs/tenants.md's table)

    assert listed["token_weights_by_model"] == {
        MODEL: {"input": 1.0, "output": output, "request": 0.0, "context": 0.0}
    }
    assert f'sluice_model_token_weight{{model="{MODEL}",token="output"}} {output}' in scraped
    assert (line["model"], line["prompt_weight"], line["output_weight"]) == (MODEL, 1.0, output)
