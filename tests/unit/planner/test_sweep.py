"""The engine-settings sweep (``planner.sweep``): the best point is the grid's highest goodput, the
knees sit on the best point's row and column, and the report renders the grid.

A 4-s synthetic workload on the A100 profile, offered 1.5x one replica's saturated throughput.
"""

from __future__ import annotations

import pytest

from gateway.admission import AdmissionSettings
from planner.plan import PlanOptions, class_targets, make_plan, with_targets
from planner.report import render_text, to_json
from planner.sweep import KNEE_SHARE
from planner.workload import LengthDist, load_workload, synthetic_workload
from simulator.profile import load_profile


def test_sweep_picks_the_best_goodput_and_its_knees() -> None:
    profile = load_profile("llama3-8b-a100")
    requests = synthetic_workload(30.0, LengthDist("const", 512), LengthDist("const", 64), 4.0, seed=2)
    workload = load_workload(requests, "test", profile.engine.max_model_len, duration_s=4.0)
    settings = with_targets(AdmissionSettings(), ["interactive"], ttft_s=0.5, tpot_s=0.04, attainment=0.9)
    options = PlanOptions(
        max_replicas=8, curve_loads=(), sweep_seqs=(16, 256), sweep_budgets=(512, 2048), sweep_seconds=4.0
    )
    plan = make_plan(workload, profile, settings, class_targets(settings, {"interactive": 1.0}), options)
    sweep = plan.sweep
    assert sweep is not None
    assert len(sweep.points) == 4
    assert sweep.best.goodput_rps == max(p.goodput_rps for p in sweep.points)
    assert sweep.rate_per_s == pytest.approx(1.5 * plan.capacity_rps)
    for knee in sweep.knees:
        other = "max_num_batched_tokens" if knee.axis == "max_num_seqs" else "max_num_seqs"
        assert knee.fixed == getattr(sweep.best, other)
        assert [getattr(p, other) for p in knee.points] == [knee.fixed] * 2
        top = max(p.goodput_rps for p in knee.points)
        at_knee = next(p for p in knee.points if getattr(p, knee.axis) == knee.knee)
        assert at_knee.goodput_rps >= KNEE_SHARE * top
    text = render_text(plan)
    assert "Engine settings" in text
    assert f"BEST: max_num_seqs={sweep.best.max_num_seqs}" in text
    assert to_json(plan)["sweep"]["best"]["goodput_rps"] == pytest.approx(sweep.best.goodput_rps)
