"""The replica count ``sluice plan`` recommends, checked by replaying it.

For small synthetic workloads (8 virtual seconds, Poisson arrivals, an A100 profile so that a
few replicas are needed), the recommended N, replayed again through the admission engine in
front of the emulator, meets every class's attainment target, and N - 1 does not. Once under
Sluice's own policy (``slo``: refusals count as misses), once under ``none`` (no admission), and
once with two classes. The search itself is checked on made-up monotone outcomes.
"""

from __future__ import annotations

import pytest

from gateway.admission import AdmissionSettings
from planner.plan import PlanOptions, class_targets, make_plan, with_targets
from planner.replicas import ClassResult, ReplayScore, class_picker, replay_at, smallest_meeting
from planner.workload import LengthDist, Workload, load_workload, synthetic_workload
from simulator.profile import load_profile

PROFILE = "llama3-8b-a100"
SECONDS = 8.0


def _fake(n: int, meets: bool) -> ReplayScore:
    cls = ClassResult("c", 100, 100 if meets else 50, 0, 0.9, 0.1, 0.2, 0.01, 0.02)
    return ReplayScore(n, (cls,), 1.0, 1.0, 1.0, 1.0, 0.5, 0)


@pytest.mark.parametrize(
    ("needed", "start", "limit"),
    [(1, 1, 8), (1, 5, 8), (3, 1, 8), (3, 3, 8), (3, 7, 8), (7, 2, 8), (13, 4, 64), (40, 1, 64)],
    ids=lambda v: str(v),
)
def test_search_finds_the_smallest_and_replays_the_one_below(needed: int, start: int, limit: int) -> None:
    calls: list[int] = []

    def evaluate(n: int) -> ReplayScore:
        calls.append(n)
        return _fake(n, n >= needed)

    found = smallest_meeting(evaluate, start, limit)
    assert found.replicas == needed
    assert found.at is not None
    assert found.at.meets
    if needed > 1:
        assert found.below is not None
        assert not found.below.meets
    assert len(calls) == len(set(calls))  # each count replayed once


def test_search_reports_when_nothing_meets() -> None:
    found = smallest_meeting(lambda n: _fake(n, False), 2, 6)
    assert found.replicas is None
    assert max(found.replays) == 6


def test_class_picker_follows_the_shares() -> None:
    pick = class_picker(
        [
            *class_targets(AdmissionSettings(), {"interactive": 3.0}),
            *class_targets(AdmissionSettings(), {"batch": 1.0}),
        ]
    )
    names = [pick(i) for i in range(4000)]
    assert pick(17) == pick(17)
    assert names.count("interactive") / len(names) == pytest.approx(0.75, abs=0.03)


def _workload(rate: float, seed: int) -> Workload:
    profile = load_profile(PROFILE)
    prompt, output = LengthDist("lognormal", 512, 0.5), LengthDist("lognormal", 96, 0.5)
    requests = synthetic_workload(rate, prompt, output, SECONDS, seed=seed)
    return load_workload(requests, "test", profile.engine.max_model_len, duration_s=SECONDS)


@pytest.mark.parametrize(
    ("policy", "rate", "mix"),
    [
        ("slo", 40.0, {"interactive": 1.0}),
        ("none", 40.0, {"interactive": 1.0}),
        ("slo", 30.0, {"interactive": 2.0, "batch": 1.0}),
    ],
    ids=["sluice", "no-admission", "two-classes"],
)
def test_recommended_count_meets_the_targets_and_one_fewer_does_not(
    policy: str, rate: float, mix: dict[str, float]
) -> None:
    profile = load_profile(PROFILE)
    workload = _workload(rate, seed=1)
    settings = AdmissionSettings().model_copy(update={"policy": policy})
    settings = with_targets(settings, ["interactive"], ttft_s=0.5, tpot_s=0.04, attainment=0.9)
    classes = class_targets(settings, mix)
    plan = make_plan(workload, profile, settings, classes, PlanOptions(max_replicas=16, curve_loads=()))
    n = plan.search.replicas
    assert n is not None
    assert n >= 2, "the workload must need more than one replica for N - 1 to mean anything"
    # Replayed again, independently of the search: N meets every class's target, N - 1 does not.
    at_n = replay_at(workload, profile, settings, classes, n)
    below = replay_at(workload, profile, settings, classes, n - 1)
    assert at_n.meets, [(c.name, c.attainment, c.target) for c in at_n.classes]
    assert not below.meets, [(c.name, c.attainment, c.target) for c in below.classes]
    assert at_n == plan.search.at
    assert below == plan.search.below
    assert at_n.goodput_rps > below.goodput_rps
