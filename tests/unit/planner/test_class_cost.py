"""The cost of each class (``planner.checks.class_cost``) from the engine time its requests took
(``planner.replicas.score_outcomes``), with hand-worked numbers."""

from __future__ import annotations

import pytest

from planner.checks import class_cost, cost_check
from planner.replicas import ClassResult, ClassTarget, score_outcomes
from replay.requests import Outcome
from simulator.profile import load_profile


def _outcome(index: int, busy_s: float, prompt: int, output: int, *, finished: bool = True) -> Outcome:
    return Outcome(
        index=index,
        tenant="t",
        arrival_s=0.0,
        prompt_tokens=prompt,
        output_tokens=output,
        rejected=False,
        reason="",
        replica="r0",
        dispatched_s=0.0,
        first_token_s=0.1,
        finished_s=1.0 if finished else None,
        tpot_s=0.01,
        busy_s=busy_s,
        preemptions=0,
    )


def test_class_cost_hand_worked() -> None:
    # 1,800 engine seconds on replicas of 2 GPUs = 1 GPU-hour = $3 at $3/GPU-hour; over a
    # replay of 3,600 s that is 24 GPU-hours a day. $3 / 1.5 M tokens = $2 per million;
    # $3 / 0.5 M output tokens = $6 per million.
    batch = ClassResult("batch", 10, 10, 0, 0.9, 1.0, 2.0, 0.05, 0.1, 1800.0, 1_500_000, 500_000)
    c = class_cost(batch, gpus_per_replica=2, price_per_gpu_hour=3.0, run_s=3600.0)
    assert c.gpu_hours == pytest.approx(1.0)
    assert c.gpu_hours_per_day == pytest.approx(24.0)
    assert c.per_million_tokens == pytest.approx(2.0)
    assert c.per_million_output_tokens == pytest.approx(6.0)
    none = ClassResult("idle", 0, 0, 0, 0.9, 1.0, 2.0, 0.05, 0.1)
    assert class_cost(none, 1, 3.0, 3600.0).per_million_tokens == float("inf")


def test_engine_time_and_tokens_are_summed_per_class() -> None:
    # Even indices are "chat", odd ones "batch". A request still running when the replay ended
    # took engine time (counted) but finished no token (not counted).
    outcomes = [
        _outcome(0, 2.0, 100, 10),
        _outcome(1, 5.0, 1000, 500),
        _outcome(2, 1.0, 50, 5),
        _outcome(3, 3.0, 800, 200, finished=False),
    ]
    classes = [ClassTarget("chat", 1.0, 0.05, 0.9), ClassTarget("batch", 60.0, 0.5, 0.9)]
    score = score_outcomes(outcomes, classes, lambda i: "chat" if i % 2 == 0 else "batch", 1, 10.0, 0.5)
    chat, batch = score.classes
    assert (chat.busy_s, chat.tokens, chat.output_tokens) == (3.0, 165, 15)
    assert (batch.busy_s, batch.tokens, batch.output_tokens) == (8.0, 1500, 500)
    # In the plan's cost check: 8 s x 1 GPU = 1/450 GPU-hour = $0.02 at $9; 1,500 tokens ->
    # $13.33 per million; 500 output tokens -> $40 per million.
    cost = cost_check(load_profile("llama3-8b-h100"), 1, 100.0, 10.0, 9.0, None, score.classes, 10.0)
    by_name = {c.name: c for c in cost.classes}
    assert by_name["batch"].gpu_hours == pytest.approx(8.0 / 3600)
    assert by_name["batch"].per_million_tokens == pytest.approx(0.02 / 1500 * 1e6)
    assert by_name["batch"].per_million_output_tokens == pytest.approx(40.0)
    assert by_name["chat"].gpu_hours_per_day == pytest.approx(3.0 / 3600 * 86400 / 10)
