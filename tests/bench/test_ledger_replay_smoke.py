"""Many gateways in virtual time (``replay.gateways``, ``bench.ledger_replay``): four gateways in
front of one emulated replica at about twice its capacity, a few virtual seconds.

With the ledger every gateway's views count the other three's in-flight requests (about all of
the replica's requests are counted at each scrape); without it they count their own only, and
the others' reach them only through the scrapes. Then the bench's ``--quick`` form end to end.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.goodput.core import FACTS, PROFILE, TARGETS, TEXT, trace_requests
from bench.ledger_replay import BEGIN, END, QUICK, Cell, main, make_gateways
from replay import FleetConfig, piecewise_rate, run_gateway_replay
from replay.gateways import ManyGateways
from simulator.profile import load_profile

GATEWAYS = 4
#: Requests per second on one replica (its capacity on this trace is about 20).
RATE = 40.0
SECONDS = 5.0


def replay(delay_s: float | None) -> ManyGateways:
    arrivals = piecewise_rate(trace_requests("azure")[0], [(SECONDS, RATE)])
    config = FleetConfig(load_profile(PROFILE), FACTS, replicas=1, text=TEXT)
    policy = make_gateways(Cell(2.0, GATEWAYS, None, delay_s, RATE / 2, QUICK))
    result = run_gateway_replay(arrivals, config, policy, targets=TARGETS)
    assert sum(1 for o in result.outcomes if o.dispatched_s is not None) > 20
    assert sorted(set(policy.owner.values())) == list(range(GATEWAYS))
    return policy


def test_with_the_ledger_every_gateway_counts_the_others_in_flight_requests() -> None:
    policy = replay(0.001)
    for g, per_replica in enumerate(policy.coverage):
        seen = per_replica["r0"]
        assert seen.scrapes >= SECONDS - 2
        assert seen.gateways_seen == {f"g{h}" for h in range(GATEWAYS) if h != g}
        assert seen.others_counted > seen.own > 0
        # All but what changed in the last millisecond: every request on the replica is counted.
        assert 0.95 <= seen.share <= 1.05, (g, seen)
    assert policy.ledger is not None
    assert policy.ledger.applied > 0


def test_without_it_each_gateway_counts_its_own_only() -> None:
    policy = replay(None)
    assert policy.ledger is None
    for g, per_replica in enumerate(policy.coverage):
        seen = per_replica["r0"]
        assert seen.others_counted == 0
        assert not seen.gateways_seen
        assert seen.own > 0
        assert seen.share < 0.5, (g, seen)  # about a quarter: its own share of the arrivals
        assert policy.gateways[g].engine.view_cache.remote is None


@pytest.mark.slow
@pytest.mark.timeout(600)  # stops a hung run only
def test_quick_bench_reports_every_cell_and_its_verdicts(tmp_path: Path) -> None:
    out, doc = tmp_path / "cells.json", tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nhand-written\n\n{BEGIN}\nSTALE-BLOCK\n{END}\n\nmore\n", encoding="utf-8")
    assert main(["--quick", "--json", str(out), "--doc", str(doc)]) == 0

    rows = json.loads(out.read_text(encoding="utf-8"))
    cells = {(r["load"], r["gateways"], r["share"], r["delay_s"]) for r in rows}
    assert cells == {
        (2.0, 1, None, None),
        (2.0, 4, None, None),
        (2.0, 4, None, 0.01),
        (2.0, 4, 0.5, 0.01),
    }
    for r in rows:
        assert 0 < r["admitted"] <= r["offered"], r
        assert 0 <= r["met"] <= r["admitted"], r
        assert 0.0 <= r["admitted_attainment"] <= 1.0, r
        assert not math.isnan(r["counted"]), r
        ledger = r["gateways"] == 1 or r["delay_s"] is not None
        assert (r["counted"] > 0.9) == ledger, r

    text = doc.read_text(encoding="utf-8")
    assert "hand-written" in text
    assert "more" in text
    assert "STALE-BLOCK" not in text
    assert text.count("| 2x |") == len(rows)
    assert text.count("goodput and admitted attainment >= 95 % of N = 1's") == 2
