"""The prefix-cache bench in its tiny configuration (``--quick``): shared blocks hit the emulated
engines' prefix caches, Sluice expects cached tokens, every verdict is reported.

Virtual time throughout (no sockets, no sleeping); seconds on an idle 2-core machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.prefix_cache import BEGIN, END, LABELS, QUICK, RIVALS, Cell, main, run_cell, verdicts, windows
from bench.verdicts import Status


@pytest.mark.slow
@pytest.mark.timeout(600)  # stops a hung run only
def test_quick_prefix_cache_bench_reports_every_policy_and_verdict(tmp_path: Path) -> None:
    out, doc = tmp_path / "cells.json", tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nhand-written\n\n{BEGIN}\nold\n{END}\n\ntail\n", encoding="utf-8")
    assert main(["--quick", "--jobs", "1", "--json", str(out), "--doc", str(doc)]) == 0

    rows = json.loads(out.read_text(encoding="utf-8"))
    results = [r for r in rows if r["kind"] == "result"]
    assert {r["policy"] for r in results} >= {*RIVALS, "sluice"}
    assert {r["load"] for r in results} == set(QUICK.loads)
    assert {(r["hit_weight"], r["load"]) for r in rows if r["kind"] == "tuning"} == {
        (w, x) for w in QUICK.hit_weights for x in QUICK.loads
    }
    assert {r["window"] for r in rows if r["kind"] == "tuning"} == {"A"}
    assert {r["window"] for r in results} == {"B"}
    for r in rows:
        assert 0.0 <= r["goodput_per_s"] <= r["offered_per_s"] + 1e-9, r
        assert r["good_tokens_per_s"] >= r["goodput_per_s"], r
        # Shared blocks hit the emulated engines' prefix caches, whatever the routing.
        assert r["hit_rate"] > 0.0, r
        assert 0.0 < r["ttft_p50_s"] <= (r["ttft_p90_s"] or math.inf), r
    sluice = [r for r in results if r["policy"] == "sluice"]
    # Sluice with prefix awareness expected cached tokens where the engines found them, and its
    # forecasts were scored; without it, it expected none.
    assert all(r["expected_cached_tokens"] > 0 and r["found_cached_tokens"] > 0 for r in sluice)
    assert all(r["ttft_forecast_n"] > 0 for r in sluice)
    assert all(r["expected_cached_tokens"] == 0 for r in results if r["policy"] == "sluice-noprefix")
    # The least-loaded and llm-d rows admit everything.
    assert all(r["rejection_rate"] == 0.0 for r in results if r["policy"] in ("least-loaded", "llm-d"))

    text = doc.read_text(encoding="utf-8")
    assert text.startswith("# Benchmarks\n\nhand-written\n\n" + BEGIN)
    assert text.endswith(END + "\n\ntail\n")
    assert "old" not in text
    assert "python -m bench.prefix_cache --quick" in text
    for policy in (*RIVALS, "sluice"):
        assert LABELS[policy] in text
    # Every target gets a verdict line: two goodput targets and the forecast's, per load.
    assert text.count("-> **") == 3 * len(QUICK.loads)


def test_verdicts_are_reported_without_data_when_a_policy_is_missing() -> None:
    from bench.prefix_cache import Run

    capacity = 5.0
    r = Run(QUICK, capacity, capacity, 1, 1)
    r.cells.append(run_cell(Cell("sluice", "B", 1.0, 0.5, capacity, QUICK)))
    got = verdicts(r)
    assert len(got) == 3 * len(QUICK.loads)
    goodput = [v for v in got if v.target.startswith("best goodput")]
    assert all(v.status is Status.NO_DATA for v in goodput)
    # Its forecast was scored at 1x (met or not, a figure); at 2x nothing was measured.
    at_1x = [v for v in got if v.target.startswith("TTFT forecast error at 1x")]
    assert at_1x[0].status is not Status.NO_DATA
    assert all(v.status is Status.NO_DATA for v in got if v.target.startswith("TTFT forecast error at 2x"))


def test_the_windows_are_disjoint_halves() -> None:
    a, b = windows(QUICK.rows)
    assert len(a) + len(b) == QUICK.rows
    assert a[-1].hash_ids != b[0].hash_ids
    assert all(r.hash_ids is not None for r in (*a, *b))
