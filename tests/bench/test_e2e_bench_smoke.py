"""The end-to-end bench in its tiny configuration: real vLLM replicas, real AIPerf, real Sluice.

``python -m bench.e2e --quick`` starts two vLLM-on-CPU replicas (the end-to-end suite's server and
tiny model) and ``sluice serve`` before them, then runs AIPerf for two tenants at once, directly
and through Sluice, for a few seconds. The test checks that AIPerf produced results for every
tenant on both paths and that Sluice answered without a 5xx; it asserts no speed (the numbers
belong to the full run, ``docs/benchmarks.md``).

AIPerf is installed (pinned) into ``.cache/bench/e2e/aiperf`` by a fixture before the test's
clock starts (``python -m bench.e2e --install-only`` does the same ahead of time). Like the e2e
suite, the test skips when vLLM or AIPerf cannot be installed here, and fails instead when
``SLUICE_REQUIRE_E2E=1`` or ``SLUICE_CI=1`` (``tests.support.skips``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.e2e import aiperf
from bench.e2e.core import BEGIN, END, HEADING, PATHS, QUICK, SHARES, write_doc
from tests.support.procs import run_bench
from tests.support.skips import REQUIRE_E2E_ENV, skip_or_fail

#: Seconds the quick run may take on the reference host, stretched by the host-speed factor (as
#: the test's own timeout is, so the run's bound stays inside it): about 90 on an idle 2-core
#: machine (vLLM starts in ~35 s, each AIPerf pair in ~20 s plus its 5 s of load); a shared,
#: busy machine needs many times that.
RUN_TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def installed(vllm_installed: None) -> None:
    """vLLM, the tiny model and AIPerf are installed (each instant when already there)."""
    try:
        aiperf.install()
    except aiperf.Unavailable as exc:
        skip_or_fail(
            f"AIPerf unavailable on this machine: {exc}",
            install="`.venv/bin/python -m bench.e2e --install-only`",
            require_env=REQUIRE_E2E_ENV,
        )


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(720, func_only=True)
def test_quick_e2e_bench_gets_aiperf_results_on_both_paths_and_no_5xx_from_sluice(
    installed: None, tmp_path: Path
) -> None:
    out, work, doc = tmp_path / "report.json", tmp_path / "work", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Goodput\n\nsomeone else's text\n", encoding="utf-8")
    args = [
        sys.executable,
        "-m",
        "bench.e2e",
        "--quick",
        "--json",
        str(out),
        "--work",
        str(work),
        "--doc",
        str(doc),
    ]
    returncode, output = run_bench(args, timeout_s=RUN_TIMEOUT_S, what="bench/e2e --quick")
    assert returncode == 0, output[-6000:]
    report = json.loads(out.read_text(encoding="utf-8"))

    rows = report["rows"]
    expected = {(label, path, tenant) for label, _ in QUICK.loads for path in PATHS for tenant in SHARES}
    assert {(r["load"], r["path"], r["tenant"]) for r in rows} == expected
    for r in rows:
        result, where = r["result"], f"{r['load']} {r['path']} {r['tenant']}: {r}"
        assert r["offered_per_s"] > 0, where
        # AIPerf completed requests and measured them: TTFT and ITL distributions exist.
        assert result["requests"] > 0, where
        assert result["request_throughput"] > 0, where
        assert 0 < result["ttft_ms"]["p50"] <= result["ttft_ms"]["p99"], where
        # ITL's median may be 0: the tiny CPU model sometimes sends several tokens in one SSE chunk,
        # which AIPerf counts as inter-token gaps of 0 ms. The tail is never all zeros.
        assert 0 <= result["itl_ms"]["p50"] <= result["itl_ms"]["p99"], where
        assert result["itl_ms"]["p99"] > 0, where
        assert sum(result["errors_by_status"].values()) == result["errors"], where
        if r["path"] == "sluice":
            # Sluice may refuse (429) or queue, but never fails a request itself.
            assert not [code for code in result["errors_by_status"] if code.startswith("5")], where
    assert report["versions"]["aiperf"] == aiperf.AIPERF_VERSION
    assert report["machine"]

    text = doc.read_text(encoding="utf-8")
    assert text.startswith("# Benchmarks\n\n## Goodput\n\nsomeone else's text\n")
    assert text.index(HEADING) < text.index(BEGIN) < text.index(END)
    assert "`python -m bench.e2e --quick" in text
    assert text.count("| sluice |") == len(SHARES) * len(QUICK.loads)


def test_write_doc_replaces_only_its_own_block(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    write_doc(f"{BEGIN}\nfirst\n{END}", doc)
    assert doc.read_text() == f"# Benchmarks\n\n{HEADING}\n\n{BEGIN}\nfirst\n{END}\n"
    doc.write_text(f"# Benchmarks\n\nbefore\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    write_doc(f"{BEGIN}\nnew\n{END}", doc)
    assert doc.read_text() == f"# Benchmarks\n\nbefore\n\n{BEGIN}\nnew\n{END}\n\nafter\n"


def test_errors_are_grouped_by_http_status_from_aiperfs_error_summary() -> None:
    summary = {
        "error_summary": [
            {"error_details": {"code": 429, "type": "Too Many Requests", "message": "a"}, "count": 3},
            {"error_details": {"code": 429, "type": "Too Many Requests", "message": "b"}, "count": 2},
            {"error_details": {"code": 503, "type": "Service Unavailable", "message": "c"}, "count": 1},
            {"error_details": {"code": None, "type": "ClientConnectorError", "message": "d"}, "count": 4},
        ]
    }
    assert aiperf.errors_by_status(summary) == {"429": 5, "503": 1, "ClientConnectorError": 4}
    assert aiperf.errors_by_status({}) == {}
