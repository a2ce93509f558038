"""Token goodput and refusals by prompt-size quartile, on hand-built outcomes
(bench/goodput/metrics.py ``score``, ``prompt_quartile_edges``, ``refusals_by_prompt_quartile``;
the results table and ``--json`` rows in bench/goodput/core.py). Pure functions, no replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from bench.goodput.core import CellResult, CellSpec, TraceRun, quartile_text, results_table, summary
from bench.goodput.metrics import (
    prompt_quartile,
    prompt_quartile_edges,
    refusals_by_prompt_quartile,
    score,
)
from replay import Outcome, Targets

TARGETS = Targets(ttft_s=1.0, tpot_s=0.05)


def served(
    prompt: int, output: int = 10, *, ttft: float = 0.2, tpot: float | None = 0.02, finished: bool = True
) -> Outcome:
    """A request sent to a replica at t=0 with ``ttft`` and ``tpot``."""
    end = 5.0 if finished else None
    return Outcome(0, "t0", 0.0, prompt, output, False, "", "r0", 0.0, ttft, end, tpot, 1.0, 0)


def refused(prompt: int, reason: str = "overloaded") -> Outcome:
    """A request the gateway refused (at once, or when its queue wait expired)."""
    return Outcome(0, "t0", 0.0, prompt, 0, True, reason, None, None, None, 0.0, None, 0.0, 0)


def never_placed(prompt: int) -> Outcome:
    """A request a replica refused and that was not placed again before the replay stopped."""
    return Outcome(0, "t0", 0.0, prompt, 0, False, "", None, None, None, None, None, 0.0, 0)


# -- good tokens -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenCase:
    name: str
    outcomes: tuple[Outcome, ...]
    met_tokens: int


TOKEN_CASES = [
    TokenCase("met counts prompt and output", (served(100, 20),), 120),
    TokenCase("a one-token answer has no TPOT and counts", (served(300, 1, tpot=None),), 301),
    TokenCase("targets are inclusive", (served(50, 5, ttft=1.0, tpot=0.05),), 55),
    TokenCase("a TTFT miss counts nothing", (served(100, 20, ttft=1.5),), 0),
    TokenCase("a TPOT miss counts nothing", (served(100, 20, tpot=0.06),), 0),
    TokenCase("unfinished counts nothing", (served(100, 20, finished=False),), 0),
    TokenCase("a refusal counts nothing", (refused(4000),), 0),
    TokenCase("never placed counts nothing", (never_placed(4000),), 0),
    TokenCase(
        "mixed: only the met ones",
        (served(100, 20), served(2000, 200, ttft=3.0), refused(8000), served(10, 2, tpot=None)),
        132,
    ),
]


@pytest.mark.parametrize("case", TOKEN_CASES, ids=[c.name for c in TOKEN_CASES])
def test_good_tokens_count_only_requests_that_met_both_targets(case: TokenCase) -> None:
    s = score(case.outcomes, TARGETS, span_s=2.0)
    assert s.met_tokens == case.met_tokens
    assert s.token_goodput == pytest.approx(case.met_tokens / 2.0)


# -- quartile edges and binning ----------------------------------------------------------------------


@dataclass(frozen=True)
class EdgeCase:
    name: str
    sizes: tuple[int, ...]
    edges: tuple[int, int, int]
    #: Requests per quartile when the same sizes are binned with those edges.
    counts: tuple[int, int, int, int]


EDGE_CASES = [
    EdgeCase("eight distinct sizes", (1, 2, 3, 4, 5, 6, 7, 8), (2, 4, 6), (2, 2, 2, 2)),
    EdgeCase("order does not matter", (8, 3, 5, 1, 7, 2, 6, 4), (2, 4, 6), (2, 2, 2, 2)),
    # Ties: the edge is a size that occurs and sizes equal to it go to the lower quartile, so the
    # quartiles hold unequal counts and the second one is empty here.
    EdgeCase("ties at the edges", (10, 10, 10, 10, 20, 20, 30, 40), (10, 10, 20), (4, 0, 2, 2)),
    EdgeCase("one request", (7,), (7, 7, 7), (1, 0, 0, 0)),
    EdgeCase("two requests", (9, 5), (5, 5, 9), (1, 0, 1, 0)),
    EdgeCase("three requests", (3, 1, 2), (1, 2, 3), (1, 1, 1, 0)),
    # One prompt size: every request is in the first quartile and the others are empty (their
    # rates are "no data", never 0 %).
    EdgeCase("every prompt the same size", (512,) * 10, (512, 512, 512), (10, 0, 0, 0)),
]


@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.name for c in EDGE_CASES])
def test_quartile_edges_and_binning(case: EdgeCase) -> None:
    edges = prompt_quartile_edges(case.sizes)
    assert edges == case.edges
    q = refusals_by_prompt_quartile([served(p) for p in case.sizes], edges)
    assert q.offered == case.counts
    assert q.refused == (0, 0, 0, 0)
    for rate, n in zip(q.rates, case.counts, strict=True):
        assert math.isnan(rate) if n == 0 else rate == 0.0


@pytest.mark.parametrize(
    ("prompt", "quartile"),
    [(0, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 2), (7, 3), (10_000, 3)],
)
def test_a_size_equal_to_an_edge_goes_to_the_lower_quartile(prompt: int, quartile: int) -> None:
    assert prompt_quartile(prompt, (2, 4, 6)) == quartile


def test_no_requests_have_no_quartiles() -> None:
    with pytest.raises(ValueError, match="at least one"):
        prompt_quartile_edges([])


def test_every_way_of_not_being_served_counts_as_refused() -> None:
    edges = (10, 20, 30)
    outcomes = [
        refused(5),  # Q1: rejected by the gateway
        refused(15, "queue timeout"),  # Q2: expired in the gateway's queue
        never_placed(25),  # Q3: a replica refused it and it was not placed again
        served(35, ttft=9.0),  # Q4: served, missed its target: served all the same
        served(36),
    ]
    q = refusals_by_prompt_quartile(outcomes, edges)
    assert q.offered == (1, 1, 1, 2)
    assert q.refused == (1, 1, 1, 0)
    assert q.rates == (1.0, 1.0, 1.0, 0.0)


def test_a_policy_refusing_only_long_prompts_shows_it_in_the_top_quartile() -> None:
    trace = list(range(1, 401))  # prompt sizes 1..400 tokens
    edges = prompt_quartile_edges(trace)
    assert edges == (100, 200, 300)
    # Two policies refusing a quarter of the requests each: one the longest quarter, one every
    # fourth request whatever its size.
    long_refuser = [refused(p) if p > 300 else served(p) for p in trace]
    even_refuser = [refused(p) if p % 4 == 0 else served(p) for p in trace]
    by_long, by_even = score(long_refuser, TARGETS, 1.0, edges), score(even_refuser, TARGETS, 1.0, edges)
    assert by_long.rejection_rate == by_even.rejection_rate == 0.25
    assert by_long.goodput == by_even.goodput == 300.0
    assert by_long.by_prompt is not None
    assert by_even.by_prompt is not None
    assert by_long.by_prompt.rates == (0.0, 0.0, 0.0, 1.0)
    assert by_even.by_prompt.rates == (0.25, 0.25, 0.25, 0.25)
    # Same request goodput; the tokens show what refusing the long ones cost.
    assert by_long.token_goodput < by_even.token_goodput
    assert quartile_text(by_long) == "0 / 0 / 0 / 100 %"


# -- the report --------------------------------------------------------------------------------------


def _trace_run(outcomes: list[Outcome], edges: tuple[int, int, int]) -> TraceRun:
    spec = CellSpec("azure", "sluice", None, ((10.0, 1.0),), (0.0, 10.0), 1.0, 100.0, 1, 0)
    cell = CellResult(spec, score(outcomes, TARGETS, 10.0, edges), 0.0)
    return TraceRun("azure", 1.0, 0, len(outcomes), 1.0, 1.0, (1.0,), cells=[cell], prompt_edges=edges)


def test_the_results_table_and_json_carry_tokens_and_quartiles() -> None:
    outcomes = [served(1000, 1000), served(2000, 1000), refused(3000), refused(4000), served(4000, 1000)]
    tr = _trace_run(outcomes, (1000, 2000, 3000))
    table = results_table(tr)
    assert "good ktok/s (prompt + output)" in table
    assert "not served by prompt quartile Q1 / Q2 / Q3 / Q4" in table
    # 2,000 + 3,000 + 5,000 good tokens over 10 s; Q3 (3,000) refused, Q4 (4,000 twice) half.
    assert "| 0.5 | 0.3 | 1.0 | 60.0 % | 40.0 % | 0 / 0 / 100 / 50 % |" in table
    (row,) = summary([tr])
    assert row["good_tokens_per_s"] == pytest.approx(1000.0)
    assert row["prompt_quartile_edges"] == [1000, 2000, 3000]
    assert row["not_served_rate_by_prompt_quartile"] == [0.0, 0.0, 1.0, 0.5]


def test_empty_quartiles_read_as_no_data_in_the_table_and_json() -> None:
    tr = _trace_run([served(512), refused(512)], (512, 512, 512))
    assert "| 50 / - / - / - % |" in results_table(tr)
    (row,) = summary([tr])
    assert row["not_served_rate_by_prompt_quartile"] == [0.5, None, None, None]
