"""The proxy-overhead bench in its tiny configuration, on the parts that need no download.

``python -m bench.overhead --quick --only direct,bare,floor,sluice`` starts the real fake backend,
a real redis-server, the bare aiohttp proxy, the floor and ``sluice serve`` with everything on,
and drives each with the bench's load tool (about 30 s on the 2-core machine). The test checks that the
table is complete and sane; it asserts no speed (the peers, which need downloads, and the
numbers themselves belong to the full run: ``docs/benchmarks.md``). The doc-writing and the
profile summary are checked on hand-built inputs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.overhead.core import BEGIN, END, HEADING, QUICK, write_doc
from bench.overhead.peers import Layout, sluice_config
from bench.overhead.profile import summarise
from bench.shared import merge_settings
from tests.support import speed

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("direct", "bare", "floor", "sluice")


@pytest.mark.slow
@pytest.mark.timeout(900)  # stops a hung run only; the subprocess's bound is scaled below
def test_quick_overhead_bench_reports_every_configuration_and_scenario_sanely(tmp_path: Path) -> None:
    out, doc = tmp_path / "report.json", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Goodput\n\nsomeone else's text\n", encoding="utf-8")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench.overhead", "--quick", "--only", ",".join(CONFIGS)),
            *("--json", str(out), "--doc", str(doc)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=speed.scaled(170),
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text(encoding="utf-8"))

    assert report["unavailable"] == {}
    scenarios = report["plan"]["scenarios"]
    assert scenarios == ["json c=1", "json c=32", "stream c=1", "stream c=32"]
    cells = {(c["config"], c["scenario"]): c for c in report["cells"]}
    assert set(cells) == {(config, s) for config in CONFIGS for s in scenarios}
    # Four tokens at 5 ms each: a stream cannot end in less than 20 ms, nor start in less than 5.
    min_stream_s = QUICK.max_tokens * QUICK.token_delay_ms / 1e3
    for (config, scenario), c in cells.items():
        where = f"{config} {scenario}: {c}"
        assert c["errors"] == {}, where
        assert c["ok"] > 0, where
        assert c["requests_per_s"] > 0, where
        assert 0 < c["p50_ms"] <= c["p99_ms"], where
        assert c["ttfb_p50_ms"] <= c["p50_ms"] + 1e-9, where
        if scenario.startswith("stream"):
            assert c["p50_ms"] >= min_stream_s * 1e3 * 0.9, where
            assert c["ttfb_p50_ms"] >= QUICK.token_delay_ms * 0.9, where
        if config == "direct":
            assert c["cpu_share"] is None, where
            assert c["requests_per_cpu_s"] is None, where
        else:
            # CPU time comes in 10 ms ticks: a light scenario may show none; a loaded one must.
            assert c["cpu_share"] is not None, where
            assert c["cpu_share"] >= 0, where
            if scenario == "json c=32":
                assert c["cpu_share"] > 0, where
                assert c["requests_per_cpu_s"] > 0, where
            assert not math.isnan(c["added_p50_ms"]), where
    # Sluice really reserves and settles in Redis (its buckets are there, not in memory): two
    # script calls per request, the commands inside them counted too.
    for s in scenarios:
        assert cells[("sluice", s)]["redis_scripts_per_request"] >= 1.0, cells[("sluice", s)]
        assert cells[("sluice", s)]["redis_per_request"] > cells[("sluice", s)]["redis_scripts_per_request"]
        # So does the floor: one reserve and one settle per request.
        assert cells[("floor", s)]["redis_scripts_per_request"] >= 1.0, cells[("floor", s)]

    text = doc.read_text(encoding="utf-8")
    # Every target is reported; LiteLLM's, not run here, as not met for want of data.
    assert [t["target"].split(" ")[1] for t in report["targets"]] == ["(everything", "adds", "keeps"]
    assert report["targets"][0]["status"] == "not met (no data)"
    assert all(t["status"] in ("met", "not met") for t in report["targets"][1:]), report["targets"]
    assert "LiteLLM not measured (json c=32) -> **not met (no data)**" in text
    assert text.startswith("# Benchmarks\n\n## Goodput\n\nsomeone else's text\n")
    assert text.index(HEADING) < text.index(BEGIN) < text.index(END)
    assert "--quick --only direct,bare,floor,sluice" in text
    assert "- the floor keeps " in text
    assert "- the floor adds +" in text
    for config in CONFIGS:
        assert text.count(f"| {config} |") == len(scenarios)


def test_write_doc_replaces_only_its_own_block(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    write_doc(f"{BEGIN}\nfirst\n{END}", doc)
    assert doc.read_text() == f"# Benchmarks\n\n{HEADING}\n\n{BEGIN}\nfirst\n{END}\n"
    doc.write_text(f"# Benchmarks\n\nbefore\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    write_doc(f"{BEGIN}\nnew\n{END}", doc)
    assert doc.read_text() == f"# Benchmarks\n\nbefore\n\n{BEGIN}\nnew\n{END}\n\nafter\n"


def _refused(*args: str) -> str:
    """``python -m bench.overhead --quick ARGS``, which must stop with a usage error (exit 2)
    before starting anything; its stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.overhead", "--quick", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    return done.stderr


def test_a_baseline_tree_without_a_gateway_is_refused_before_anything_starts(tmp_path: Path) -> None:
    assert "holds no gateway/cli.py" in _refused("--baseline-tree", str(tmp_path))


def test_profile_summary_counts_self_inclusive_packages_and_callers() -> None:
    site = "/x/.venv/lib/python3.11/site-packages"
    handle = f"handle ({ROOT}/gateway/proxy/forward.py)"
    raw = "\n".join(
        [
            f"<module> ({ROOT}/gateway/cli.py);{handle};write ({site}/aiohttp/http_writer.py) 6",
            f"<module> ({ROOT}/gateway/cli.py);{handle};parse ({ROOT}/gateway/api/openai.py) 3",
            f"<module> ({ROOT}/gateway/cli.py);{handle} 1",
        ]
    )
    profile = summarise(raw)
    assert profile.samples == 10
    top = profile.top_self[0]
    assert (top.name, top.share) == ("write (aiohttp/http_writer.py)", 0.6)
    assert (top.caller, top.caller_part) == ("handle (gateway/proxy/forward.py)", 1.0)
    assert {c.name: c.share for c in profile.by_package} == {
        "aiohttp": 0.6,
        "gateway/api/openai.py": 0.3,
        "gateway/proxy/forward.py": 0.1,
    }
    assert {c.name: c.share for c in profile.by_sluice_frame} == {
        "handle (gateway/proxy/forward.py)": 0.7,
        "parse (gateway/api/openai.py)": 0.3,
    }
    inclusive = {c.name: c.share for c in profile.top_inclusive}
    assert inclusive["handle (gateway/proxy/forward.py)"] == 1.0
    assert "<module> (gateway/cli.py)" not in inclusive  # the root chain is left out


@pytest.mark.parametrize(
    ("spec", "message"),
    [("redis-off={not json}", "not JSON"), ("=[]", "want LABEL=JSON"), ("x=[1]", "want LABEL=JSON")],
    ids=["not JSON", "no label, not an object", "not an object"],
)
def test_a_bad_variant_is_refused_before_anything_starts(spec: str, message: str) -> None:
    assert message in _refused("--variant", spec)


def test_a_variant_merges_its_settings_into_everything_on(tmp_path: Path) -> None:
    """``--variant``'s settings go into Sluice's everything-on configuration key by key: the rest
    of each section stays."""
    layout = Layout(None, None, tmp_path, "http://127.0.0.1:2", "redis://127.0.0.1:1/0", 1)
    base = sluice_config(layout, 3)
    patched = sluice_config(
        layout, 3, patch={"limits": {"backend": "memory"}, "logging": {"access_log": False}}
    )
    assert patched["limits"] == {**base["limits"], "backend": "memory"}
    assert patched["logging"] == {**base["logging"], "access_log": False}
    assert {k: v for k, v in patched.items() if k not in ("limits", "logging")} == {
        k: v for k, v in base.items() if k not in ("limits", "logging")
    }
    assert merge_settings({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 5}, "d": {"e": 1}}) == {
        "a": {"b": 5, "c": 2},
        "d": {"e": 1},
    }
