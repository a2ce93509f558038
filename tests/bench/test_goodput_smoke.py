"""The goodput bench end to end in its tiny configuration (``--quick``): every policy at every load.

Virtual time throughout (no sockets, no sleeping); under a minute on an idle 2-core machine.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench.goodput.core import BEGIN, END, LABELS, POLICIES, QUICK, SLUICES, main


@pytest.mark.slow
@pytest.mark.timeout(900)  # stops a hung run only: two busy loops beside it make it 3-5x slower
def test_quick_goodput_bench_reports_every_policy_and_load_with_sane_numbers(tmp_path: Path) -> None:
    out, doc, img = tmp_path / "cells.json", tmp_path / "benchmarks.md", tmp_path / "img"
    doc.write_text(
        f"# Benchmarks\n\nhand-written text\n\n{BEGIN}\nold\n{END}\n\nmore text\n", encoding="utf-8"
    )
    assert main(["--quick", "--jobs", "1", "--json", str(out), "--doc", str(doc), "--img-dir", str(img)]) == 0

    rows = json.loads(out.read_text(encoding="utf-8"))
    loads = [r for r in rows if r["kind"] == "load"]
    assert {(r["policy"], r["load"]) for r in loads} == {(p, x) for p in POLICIES for x in QUICK.loads}
    assert {r["policy"] for r in rows if r["kind"] == "spike"} == set(POLICIES)
    assert {r["policy"] for r in rows if r["kind"] == "tuning"} == {p for p, _ in QUICK.grids}
    # The grids are replayed at every tuning load (the knob is chosen at 1x, the 2x comparison
    # takes the best of each grid there).
    tuning = {(r["policy"], r["knob"], r["load"]) for r in rows if r["kind"] == "tuning"}
    assert tuning == {(p, k, x) for p, grid in QUICK.grids for k in grid for x in QUICK.tune_loads}
    for r in rows:
        assert r["offered"] > 0, r
        assert 0.0 <= r["goodput_per_s"] <= r["offered_per_s"] + 1e-9, r
        assert 0.0 <= r["attainment"] <= 1.0, r
        assert 0.0 <= r["rejection_rate"] <= 1.0, r
        assert r["met"] + r["rejected"] <= r["offered"], r
        assert 0.0 <= r["wasted"] <= 1.0, r
        assert r["good_tokens_per_s"] >= r["goodput_per_s"], r  # a met request has >= 1 token
        assert all(x is None or 0.0 <= x <= 1.0 for x in r["not_served_rate_by_prompt_quartile"]), r
    # One set of quartile edges per trace, whatever the policy or load.
    edges = {(r["trace"], tuple(r["prompt_quartile_edges"])) for r in rows}
    assert len(edges) == len(QUICK.traces), edges
    assert all(list(e) == sorted(e) for _, e in edges), edges
    # Policies that never refuse refuse nothing; the load grows with the offered load.
    assert all(r["rejection_rate"] == 0.0 for r in loads if r["policy"] == "none")
    assert all(
        x in (0.0, None)
        for r in loads
        if r["policy"] == "none"
        for x in r["not_served_rate_by_prompt_quartile"]
    )
    by_load = sorted((r["load"], r["offered_per_s"]) for r in loads if r["policy"] == "none")
    assert [o for _, o in by_load] == sorted(o for _, o in by_load)
    for r in rows:
        if r["kind"] == "spike":
            assert r["recovery_s"] is None or 0.0 <= r["recovery_s"] <= QUICK.post_s, r
            assert r["rejections_stop_s"] is not None
            assert 0.0 <= r["rejections_stop_s"] <= QUICK.post_s, r

    text = doc.read_text(encoding="utf-8")
    assert text.startswith("# Benchmarks\n\nhand-written text\n\n")
    assert text.endswith("\n\nmore text\n")
    assert "old" not in text
    assert ".venv/bin/python -m bench.goodput --quick" in text
    for policy in POLICIES:
        assert LABELS[policy] in text
    assert "not served by prompt quartile Q1 / Q2 / Q3 / Q4" in text
    assert "cut once over all" in text
    assert text.count("| (e) Sluice | - |") == len(QUICK.loads)
    # Every target of both Sluice rows has a verdict line, with one of the three verdicts.
    verdicts = [x for x in text.splitlines() if x.startswith("- ") and " -> **" in x]
    assert len(verdicts) == 6 * len(SLUICES) * len(QUICK.traces), verdicts
    assert all(x.endswith(("**met**", "**not met**", "**not met (no data)**")) for x in verdicts), verdicts
    assert sum("knobs tuned at 1x and 2x" in x for x in verdicts) == len(SLUICES) * len(QUICK.traces)
    if importlib.util.find_spec("matplotlib") is not None:
        assert sorted(p.name for p in img.iterdir()) == [
            "goodput-spike-quick.png",
            "goodput-vs-load-quick.png",
        ]
        assert "](img/goodput-vs-load-quick.png)" in text
    else:
        assert not img.exists()
