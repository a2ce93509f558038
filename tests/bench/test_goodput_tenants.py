"""The goodput bench per tenant: the replay prices budgets as the gateway does by default, and
the per-tenant table reports every tenant's goodput and the spread (hand-built cells, no replay).
"""

from __future__ import annotations

from bench.goodput.core import CellResult, CellSpec, TraceRun, admission_settings, tenant_table
from bench.goodput.metrics import Score
from gateway.limits.config import LimitsSettings
from gateway.tenants.pricing import PLAIN_WEIGHTS, configured_weights
from replay.budget import DEFAULT_WEIGHTS, MemoryBudget
from replay.policies import SluicePolicy

SPAN_S = 10.0


def test_the_replay_prices_budgets_with_the_gateways_default_weights() -> None:
    default = configured_weights(LimitsSettings())
    assert default == PLAIN_WEIGHTS == DEFAULT_WEIGHTS
    assert MemoryBudget({}).weights() == default
    policy = SluicePolicy(admission_settings(), budgets={})
    assert policy.budget is not None
    assert policy.budget.weights("any-model") == default


def _cell(load: float, met_by_tenant: dict[str, int], policy: str = "sluice") -> CellResult:
    spec = CellSpec("azure", policy, None, ((SPAN_S, load),), (0.0, SPAN_S), 1.0, 100.0, 1, 0)
    scores = {
        name: Score(offered=10, met=met, rejected=10 - met, span_s=SPAN_S, wasted=0.0, busy_s=1.0)
        for name, met in met_by_tenant.items()
    }
    total = sum(met_by_tenant.values())
    whole = Score(offered=10 * len(scores), met=total, rejected=0, span_s=SPAN_S, wasted=0.0, busy_s=1.0)
    return CellResult(spec, whole, 0.0, by_tenant=scores)


def test_tenant_table_gives_each_tenants_goodput_attainment_and_the_spread() -> None:
    run = TraceRun("azure", 1.0, 0, 100, 50.0, 50.0)
    run.cells = [
        _cell(2.0, {"t0": 8, "t1": 4}),
        _cell(1.0, {"t0": 10, "t1": 10}),
        _cell(1.0, {"t0": 1, "t1": 1}, policy="none"),
    ]
    rows = tenant_table(run).splitlines()
    assert (
        rows[0]
        == "| load | t0: goodput req/s (attainment) | t1: goodput req/s (attainment) | lowest / highest |"
    )
    # Loads in order; the other policy's cell is not in Sluice's table.
    assert rows[2:] == [
        "| 1x | 1.00 (100 %) | 1.00 (100 %) | 1.00 |",
        "| 2x | 0.80 (80 %) | 0.40 (40 %) | 0.50 |",
    ]


def test_tenant_table_says_so_when_no_cell_was_scored_per_tenant() -> None:
    run = TraceRun("azure", 1.0, 0, 100, 50.0, 50.0)
    assert tenant_table(run) == "No (e) Sluice cell scored per tenant.\n"
