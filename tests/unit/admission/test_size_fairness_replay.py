"""No starvation by size, in virtual time: at 2x load the longest prompts keep at least a third
of the shortest's admission rate.

The replay (``replay.admission.run_gateway_replay``) runs the shipped ``AdmissionEngine``
(``replay.policies.SluicePolicy``) in front of one emulated vLLM, as the goodput bench does
(``bench.goodput.core``: the Azure conversation trace, its interactive class, prompts sent as
text), at twice the replica's measured capacity. Without ``size_fairness`` the longest quartile
is refused first (every refusal there is the running streams' stall budget); with it (the
default) its requests wait first in the queue while the others are held back.
"""

from __future__ import annotations

import functools
from typing import Final

from bench.goodput.core import (
    FACTS,
    PROFILE,
    TARGETS,
    TEXT,
    admission_settings,
    trace_prompt_edges,
    trace_requests,
)
from bench.goodput.metrics import Score, score
from replay import FleetConfig, measure_capacity, piecewise_rate, run_gateway_replay
from replay.policies import SluicePolicy
from simulator.profile import load_profile

LOAD: Final = 2.0
WARMUP_S: Final = 10.0
SCORED_S: Final = 40.0
COOLDOWN_S: Final = 5.0
#: Lower bound on the longest quartile's admission rate over the shortest's.
MIN_RATIO: Final = 1.0 / 3.0
#: Most request goodput the protection may cost at this load (its price: short prompts held back).
MAX_GOODPUT_COST: Final = 0.15


@functools.cache
def replay(enabled: bool) -> Score:
    """The trace at ``LOAD`` through Sluice with ``size_fairness.enabled`` so (cached)."""
    trace, _ = trace_requests("azure")
    profile = load_profile(PROFILE)
    capacity = measure_capacity(profile, trace[:400], seed=0)
    arrivals = piecewise_rate(trace, [(WARMUP_S + SCORED_S + COOLDOWN_S, LOAD * capacity)])
    config = FleetConfig(profile, FACTS, replicas=1, seed=0, text=TEXT)
    settings = admission_settings((("class.size_fairness.enabled", enabled),))
    scored = (WARMUP_S, WARMUP_S + SCORED_S)
    result = run_gateway_replay(arrivals, config, SluicePolicy(settings), targets=TARGETS, scored=scored)
    outcomes = [o for o in result.outcomes if scored[0] <= o.arrival_s < scored[1]]
    return score(outcomes, TARGETS, SCORED_S, trace_prompt_edges("azure"))


def admission_ratio(s: Score) -> float:
    """The longest quartile's share of requests served over the shortest's."""
    assert s.by_prompt is not None
    rates = s.by_prompt.rates
    return (1.0 - rates[3]) / (1.0 - rates[0])


def test_without_it_the_longest_prompts_are_shut_out() -> None:
    off = replay(False)
    assert off.rejection_rate > 0.25, "2x load must overload the replica"
    assert admission_ratio(off) < MIN_RATIO


def test_the_longest_quartile_keeps_a_third_of_the_shortests_rate() -> None:
    on, off = replay(True), replay(False)
    assert admission_ratio(on) >= MIN_RATIO, (on.by_prompt, off.by_prompt)
    # Its price, bounded: fewer requests meet their targets, as many tokens or more, no waste.
    assert on.goodput >= (1.0 - MAX_GOODPUT_COST) * off.goodput
    assert on.token_goodput >= 0.95 * off.token_goodput
    assert on.wasted < 0.02
