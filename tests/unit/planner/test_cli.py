"""``sluice plan``'s command line (``planner.cli``) and its workload inputs (``planner.workload``).

Small workloads only (a few virtual seconds at a few requests per second): what is checked is
the wiring (options to plan, report and JSON, exit codes), not the numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway import cli as gateway_cli
from planner.cli import main
from planner.workload import LengthDist, load_workload, parse_length_dist, read_trace
from replay.traces import TraceRequest

SMALL = ["--rate", "4", "--prompt-tokens", "256", "--output-tokens", "uniform:16:48", "--duration-s", "4"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512", LengthDist("const", 512.0)),
        ("uniform:10:20", LengthDist("uniform", 10, 20)),
        ("lognormal:800:0.8", LengthDist("lognormal", 800.0, 0.8)),
    ],
)
def test_length_dists_parse(text: str, expected: LengthDist) -> None:
    assert parse_length_dist(text) == expected


@pytest.mark.parametrize("text", ["0", "uniform:20:10", "lognormal:800", "zipf:1:2", "x"])
def test_bad_length_dists_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected N"):
        parse_length_dist(text)


def test_both_trace_formats_are_read(tmp_path: Path) -> None:
    azure = tmp_path / "azure.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.0000000,100,10\n2023-11-16 18:15:47.5000000,200,20\n",
        encoding="utf-8",
    )
    mooncake = tmp_path / "mooncake.csv"
    mooncake.write_text("timestamp_ms,input_length,output_length\n0,100,10\n3000,200,20\n", encoding="utf-8")
    assert read_trace(azure) == [TraceRequest(0.0, 100, 10), TraceRequest(1.5, 200, 20)]
    assert [r.prompt_tokens for r in read_trace(mooncake)] == [100, 200]
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unknown format"):
        read_trace(other)


def test_workload_slice_rate_and_model_len() -> None:
    requests = [TraceRequest(float(i), 100 * (i + 1), 10) for i in range(10)]
    # Arrivals 2..5 s (4 requests), re-based to 0; prompt + output 310, 410, 510, 610 tokens:
    # the last does not fit 550.
    w = load_workload(requests, "t", 550, start_s=2.0, duration_s=4.0)
    assert [r.arrival_s for r in w.requests] == [0.0, 1.0, 2.0]
    assert (w.too_long, w.duration_s) == (1, 4.0)
    # Re-timed to 2 req/s: gaps halved; the span is 10 requests / 2 = 5 s.
    fast = load_workload(requests, "t", 10_000, rate_per_s=2.0)
    assert fast.requests[1].arrival_s == pytest.approx(0.5)
    assert fast.rate_per_s == pytest.approx(2.0)


def test_plan_prints_the_report_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    code = main(
        [*SMALL, "--price-per-gpu-hour", "2", "--ttft-s", "1", "--curve-loads", "", "--json", str(out)]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "RECOMMENDED: 1 replica(s)" in printed
    assert "not computed: missing PCIe bandwidth" in printed
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["replicas"] == 1
    assert data["at_n"]["meets"] is True
    assert data["classes"][0]["ttft_s"] == 1.0
    assert data["cost"]["price_per_gpu_hour"] == 2.0
    assert data["swap"]["break_even"] is None


def test_latency_curve_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    code = main([*SMALL, "--curve-loads", "0.3,1.2", "--plot-dir", str(tmp_path), "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "Latency against utilisation" in printed
    curve = json.loads(out.read_text(encoding="utf-8"))["curve"]
    assert [p["load"] for p in curve] == [0.3, 1.2]
    # Past saturation the queue grows: the p99 TTFT at 120 % is above the one at 30 %.
    assert curve[1]["ttft_p99_s"] > curve[0]["ttft_p99_s"]
    assert (tmp_path / "latency-vs-utilisation.png").stat().st_size > 0


CONFIG = """\
emulators:
  - name: emu-0
    profile: llama3-8b-h100
    port: 8101
admission:
  default_class: chat
  classes:
    chat: {ttft_target_s: 0.8, tpot_target_s: 0.06, attainment_target: 0.9}
    offline: {ttft_target_s: 30, tpot_target_s: 0.2, max_queue_wait_s: 30, priority: 5}
"""


def test_classes_and_targets_come_from_a_config_file(tmp_path: Path) -> None:
    config = tmp_path / "sluice.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    out = tmp_path / "plan.json"
    argv = [*SMALL, "--config", str(config), "--class", "chat=3", "--class", "offline=1"]
    assert main([*argv, "--curve-loads", "", "--json", str(out)]) == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    assert [(c["name"], c["ttft_s"], c["tpot_s"], c["attainment"], c["share"]) for c in data["classes"]] == [
        ("chat", 0.8, 0.06, 0.9, 3.0),
        ("offline", 30.0, 0.2, 0.95, 1.0),
    ]
    assert [c["name"] for c in data["at_n"]["classes"]] == ["chat", "offline"]
    # Without --class, the configuration's default class takes all the traffic.
    assert main([*SMALL, "--config", str(config), "--curve-loads", "", "--json", str(out)]) == 0
    assert [c["name"] for c in json.loads(out.read_text(encoding="utf-8"))["classes"]] == ["chat"]


@pytest.mark.parametrize(
    "argv",
    [
        [*SMALL, "--curve-loads", "a,b"],
        [*SMALL, "--sweep-seqs", "0"],
        [*SMALL, "--config", "/nonexistent.yaml"],
        [*SMALL, "--curve-loads", "0"],
        ["--rate", "4"],
        [*SMALL, "--class", "nosuch"],
        [*SMALL, "--profile", "nosuch"],
        ["--trace", "/nonexistent.csv"],
    ],
    ids=[
        "curve-not-numbers",
        "sweep-zero",
        "missing-config",
        "curve-zero",
        "no-lengths",
        "unknown-class",
        "unknown-profile",
        "missing-trace",
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("sluice plan: ")


def test_sluice_plan_runs_the_planner_from_the_checkout(capfd: pytest.CaptureFixture[str]) -> None:
    # `sluice plan` is `python -m planner` in a child process (the gateway never imports it).
    assert gateway_cli.main(["plan", "--rate", "4"]) == 2
    assert "sluice plan: give --trace FILE" in capfd.readouterr().err
