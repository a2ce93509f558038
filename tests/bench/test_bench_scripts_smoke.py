"""Every bench script that no other test starts, started in its tiniest configuration.

Each case runs ``python -m bench.<name> <tiny args>`` from the repository root, as a person would,
and checks that it exits 0 and prints what it promises: its table's header and every row (every
operation, limiter, profile, configuration...), with values where numbers belong. It asserts no
timing and no speed: those belong to full runs on a quiet machine (``docs/benchmarks.md``).
The benches that need real processes start them themselves (``redis-server`` through
``tests/support/redis.py``, the emulator, ``sluice serve``, ``taskset``), as in a full run; a
missing ``redis-server`` is an error, as in the Redis suites (``make system-deps`` installs it).

Not here: ``bench.overhead``, ``bench.goodput`` and ``bench.e2e`` (their own smoke tests in this
folder), ``bench.overhead.backend`` / ``bench.overhead.bare`` (started by ``bench.overhead``'s),
``bench.admission_load`` and ``bench.live_accuracy`` (libraries, no script), and
``bench.predictor_accuracy_vllm``: it needs the real vLLM on CPU, minutes even tiny (the e2e
suite and ``test_e2e_bench_smoke.py`` cover that stack).
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from bench.forecast_bound import ORACLES
from bench.goodput.ablation import BASELINE_KV, VARIANTS
from bench.predictor_accuracy import FACTS
from simulator.profile import list_profiles
from tests.support import speed

ROOT = Path(__file__).resolve().parents[2]

Check = Callable[[str], None]


def run_bench(module: str, args: Sequence[str], timeout_s: float) -> str:
    """``python -m MODULE ARGS`` from the repository root; its stdout once it exited 0.

    ``timeout_s`` is for an idle host; it is stretched by the host-speed factor, since it only
    stops a hung run. On timeout it gets SIGINT first (its ``with`` blocks then stop what it
    started: replicas, gateways, ``redis-server``), then its process group is killed."""
    timeout_s = speed.scaled(timeout_s)
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{module} still running after {timeout_s:g} s:\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"{module} exited {proc.returncode}:\n{out[-3000:]}\n{err[-4000:]}"
    return out


def row(out: str, label: str, numbers: int) -> list[str]:
    """The fields after ``label`` on the output's one line that starts with it (leading spaces
    aside) followed by ``numbers`` numbers (not nan; a trailing ``%`` allowed)."""

    def numeric(field: str) -> bool:
        try:
            value = float(field.rstrip("%"))
        except ValueError:
            return False
        return value == value  # not nan

    found = []
    for line in out.splitlines():
        text = line.strip()
        if text.startswith(label):
            fields = text[len(label) :].split()
            if len(fields) >= numbers and all(numeric(f) for f in fields[:numbers]):
                found.append(fields)
    assert len(found) == 1, f"want one row {label!r} with {numbers} numbers, got {found}:\n{out}"
    return found[0]


def has_line(out: str, pattern: str) -> re.Match[str]:
    """The first line matching the regular expression ``pattern`` (from its start)."""
    found = re.search(pattern, out, re.MULTILINE)
    assert found is not None, f"no line matching {pattern!r}:\n{out}"
    return found


def md_rows(out: str, header_start: str) -> list[list[str]]:
    """The cells of each row of the markdown table whose header starts with ``header_start``
    (the first such table)."""
    lines = out.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header_start)), None)
    assert start is not None, f"no table {header_start!r}:\n{out}"
    assert lines[start + 1].startswith("|---"), lines[start + 1]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


# -- the checks, per script --------------------------------------------------------------------------


def check_admission_cost(out: str) -> None:
    has_line(out, r"operation\s+median us/call\s+best us/call\s+notes$")
    for label, note in [
        ("forecasts only: 8 replicas", "8 Forecast objects"),
        ("forecast numbers only: 8 replicas", "forecast_values"),
        ("decision: admit (8 replicas)", "-> Admit"),
        ("decision: admit batch", "-> Admit, +8 probe forecasts"),
        ("decision: queue + cancel", "held by streams"),
        ("decision: reject + Retry-After", "-> Reject (flood path)"),
        ("decision: reject, 1 replica", "-> Reject"),
        ("re-evaluate: 1 entry kept", "per examined entry"),
        ("view build: 256 streams", "per scrape / finish"),
    ]:
        fields = row(out, label, 2)
        assert " ".join(fields[2:]).startswith(note), (label, fields)
    has_line(out, r"one decision over 8 replicas: [\d.]+ us median, (within|over) the 100 us target")


def check_emulator_step_times(out: str) -> None:
    decode = md_rows(out, "| profile | B=1 | B=8 |")
    prefill = md_rows(out, "| profile | N=128 |")
    for rows, columns in ((decode, 8), (prefill, 5)):
        assert [r[0] for r in rows] == list_profiles(), rows
        for r in rows:
            assert len(r) == columns, r
            assert all(float(cell) > 0 for cell in r[1:]), r


def check_forecast_cost(out: str) -> None:
    has_line(out, r"operation\s+median us/call\s+notes$")
    for name in (
        "idle",
        "light",
        "busy-aggregates",
        "kv-full-aggregates",
        "detail-64",
        "detail-256",
        "detail-1000",
        "long-prompt-ahead",
    ):
        fields = row(out, f"forecast: {name} ", 1)
        assert fields[1] == "ttft", fields
        assert fields[-1].startswith("valid="), fields
    for label in (
        "sweep: 8 replicas",
        "output length p90 (tenant)",
        "prompt tokens from chars",
        "service: state build, 64 in flight",
        "service.forecast, 64 in flight",
        "service: state build, 500 in flight",
        "service.forecast, 500 in flight",
        "calibration fit (512 obs)",
    ):
        row(out, label, 1)
    has_line(out, r"one forecast on one replica .*: [\d.]+ us median .*(within|over) the 20 us target")


def check_limiter_cost(out: str) -> None:
    has_line(out, r"limiter cost: 20 sequential admissions, then 4 concurrent tasks")
    has_line(
        out,
        r"limiter\s+reserve p50 us\s+reserve p99 us\s+settle p50 us\s+admissions/s\s+over-limit p50 us$",
    )
    for name in ("off", "memory", "redis", "redis+policy", "cluster+policy"):
        assert len(row(out, f"{name} ", 5)) == 5
    has_line(out, r"event loop: \w+$")


def check_scrape_parse(out: str) -> None:
    has_line(out, r"scrape parse cost: 1 parses per scrape and parser")
    for name in ("vLLM 0.32 (CPU, real)", "vLLM 0.10 (CPU, real)", "SGLang 0.4 (docs)", "TGI emulator"):
        assert len(row(out, name, 5)) == 5


def check_gc_pauses(out: str) -> None:
    rows = md_rows(out, "| scenario | configuration |")
    assert [(r[0], r[1]) for r in rows] == [("json c=32", "this"), ("stream c=32", "this")], rows
    for cells in rows:
        assert float(cells[2]) > 0, cells  # requests/s
        assert all(float(cells[i]) >= 0 for i in (3, 4, 5, 7, 8)), cells
        assert len([float(n) for n in cells[6].split(" / ")]) == 3, cells


def check_tenancy_cost(out: str) -> None:
    has_line(out, r"tenancy cost through the gateway: 10 sequential requests per row")
    has_line(out, r"tenancy\s+p50 ms\s+p99 ms\s+added p50 us\s+requests/s$")
    for name in ("off", "memory", "redis", "cluster"):
        assert len(row(out, f"{name} ", 4)) == 4
    has_line(out, r"event loop: \w+$")


PIECES = ("request id", "error body", "error response", "access line (text)", "sum")


def check_rejection_pieces(out: str) -> None:
    has_line(out, r"piece of a 429\s+generic us\s+Sluice us$")
    for piece in PIECES:
        assert len(row(out, piece, 2)) == 2


def check_rejection_flood(out: str) -> None:
    has_line(out, r"(gateway pinned to core 0 \(taskset\)|one core only)")
    has_line(
        out,
        r"\s*access log\s+429/s\s+gw CPU\s+of it sys\s+429/CPU-s\s+bg CPU\s+us/429 added\s+flood sent"
        r"\s+admitted ok\s+failed\s+adm TTFT p50$",
    )
    for label in ("off", "on"):
        fields = row(out, f"{label} ", 10)
        assert int(fields[6]) > 0, f"access log {label}: the flood sent nothing: {fields}"
        statuses = has_line(out, rf"access log {label}: flood statuses (\{{.*\}})$").group(1)
        assert 429 in ast.literal_eval(statuses), f"access log {label}: no 429 answered: {statuses}"
    has_line(out, r"target: >= 5000 rejections per CPU-second")
    has_line(out, r"load average \(1, 5, 15 min\) before: .*; after: ")


def check_rejection_replay(out: str) -> None:
    found = has_line(
        out,
        r"tree \S+ \(access log on\): (\d+) rejections, handle \+ finish thread CPU per 429: "
        r"p10 [\d.]+ us, p25 [\d.]+ us, median [\d.]+ us; loop thread [\d.]+ us per 429 over the "
        r"rounds; load average ",
    )
    assert int(found.group(1)) > 0


def check_slowloris(out: str) -> None:
    for name in ("idle", "header dribbler", "body dribbler"):
        has_line(out, rf"\s*{name}: (answered|closed|still open)")
    # The quick configuration's read timeout (2 s) falls inside its watch (6 s).
    has_line(out, r"\s*body dribbler: answered 'HTTP/1\.1 408 Request Timeout'")


def check_ablation(out: str) -> None:
    rows = md_rows(out, "| policy | seed | load | goodput req/s |")
    labels = [f"Sluice, {VARIANTS[i][0]}" for i in (0, 1)]
    got = sorted((r[0], r[2]) for r in rows)
    want = [(label, load) for label in labels for load in ("1x", "spike")]
    want.append((f"saturation shedding, KV > {BASELINE_KV:g}", "1x"))
    assert got == sorted(want), rows
    for r in rows:
        assert len(r) == 11, r
        for cell in r[3:8]:
            float(cell.rstrip(" %"))
        served = r[9].removesuffix(" %").split(" / ")
        assert len(served) == 4, r
        for cell in [*served, r[10]]:
            assert cell == "-" or float(cell) >= 0, r
    accuracy = md_rows(out, "| trace | policy | seed | load | served |")
    assert sorted((r[1], r[3]) for r in accuracy) == sorted(w for w in want if w[0] in labels), accuracy


def check_timeline(out: str) -> None:
    has_line(out, r"direct: client p50 [\d.]+ ms \(\d+ requests\)$")
    blocks = re.split(r"\n\n(?=\S)", out)
    for name in ("bare", "sluice-lean", "sluice"):
        block = next((b for b in blocks if b.startswith(f"{name}: client p10")), None)
        assert block is not None, f"no block for {name}:\n{out}"
        has_line(block, r"\s+stage \(> enter, < leave\)\s+wall p50 us\s+p90\s+CPU p50 us\s+n$")
        for stage in ("rx", "aiohttp _handle_request >", "tx upstream", "upstream rx", "tx to client"):
            assert len(row(block, f"{stage} ", 4)) == 4
        if name != "bare":
            for stage in ("Proxy.handle >", "LiveAdmission.admit >", "Proxy.handle <"):
                row(block, stage, 4)


def check_predictor_accuracy(out: str) -> None:
    header = "| profile | load | req/s | n | TTFT mean |"
    tables = out.split(header)[1:]  # the trace's first slice, then the check slice
    assert len(tables) == 2, out
    for table in tables:
        rows = md_rows(header + table, header)
        assert [(r[0], r[1]) for r in rows] == [(p, "60 %") for p in FACTS], rows
        for r in rows:
            assert len(r) == 12, r
            assert int(r[3]) > 0, r


def check_forecast_bound(out: str) -> None:
    rows = md_rows(out, "| load | latency | n | forecast |")
    forecasts = ["shipped", *ORACLES.values()]
    assert [(r[1], r[3]) for r in rows] == [(m, f) for m in ("TTFT", "TPOT") for f in forecasts], rows
    for r in rows:
        assert r[0] == "60 %", r
        assert int(r[2]) > 0, r
        assert re.fullmatch(r"(yes\*?|\*\*no\*\*) / (yes\*?|\*\*no\*\*)", r[7]), r
        for cell in r[4:7]:  # "12.1 % (8.0 %-20.3 %)" or "18.1 %"
            assert re.fullmatch(r"[\d.]+ %( \([\d.]+ %-[\d.]+ %\))?", cell), r


def check_onset(out: str) -> None:
    rows = md_rows(out, "| trace | seed | outputs |")
    assert [(r[0], r[1], r[2]) for r in rows] == [("azure", "0", "pinned"), ("azure", "0", "predicted")], rows
    for r in rows:
        arrived, admitted = int(r[4]), int(r[5])
        assert 0 < admitted <= arrived, r
        assert re.fullmatch(r"[\d.]+ %", r[6]), r
        bins = [tuple(int(n) for n in cell.split("/")) for cell in r[8].split()]
        assert len(bins) == 2, r  # 10 s of overload in bins of 5 s
        assert sum(a for a, _ in bins) == admitted, r
        assert all(0 <= m <= a for a, m in bins), r
    sums = md_rows(out, "| trace | outputs | runs |")
    assert [(r[0], r[1], r[2]) for r in sums] == [("azure", "pinned", "1"), ("azure", "predicted", "1")], sums


def check_soak(out: str) -> None:
    has_line(out, r"\s+t \(s\)\s+RSS \(MiB\)\s+fds$")
    for name in ("before load", "after warm-up", "end of load", "after idle"):
        assert len(row(out, name, 3)) == 3
    has_line(out, r"answers: .*200: \d+")
    has_line(out, r"requests: \d+; limiter: redis$")
    has_line(out, r"redis-server RSS [\d.]+ -> [\d.]+ MiB; keys after the load: \d+$")
    assert "FAIL:" not in out


# -- the cases ----------------------------------------------------------------------------------------


def case(
    module: str, args: Sequence[str], timeout_s: float, check: Check, *, slow: bool = True, name: str = ""
) -> object:
    """One script's tiny run: ``slow`` when it takes more than a few seconds (real processes)."""
    return pytest.param(
        module,
        list(args),
        timeout_s,
        check,
        marks=[pytest.mark.slow] if slow else [],
        id=name or module.removeprefix("bench."),
    )


CASES = [
    # In process, timing loops: one call per sample, one sample.
    case("bench.admission_cost", ["--batch", "1", "--samples", "1"], 60, check_admission_cost, slow=False),
    case("bench.emulator_step_times", [], 60, check_emulator_step_times, slow=False),
    case("bench.forecast_cost", ["--batch", "1", "--samples", "1"], 60, check_forecast_cost, slow=False),
    case(
        "bench.rejection_flood",
        ["--pieces"],
        60,
        check_rejection_pieces,
        slow=False,
        name="rejection_flood-pieces",
    ),
    # A redis-server and a three-master Redis Cluster of their own: every limiter row.
    case(
        "bench.limiter_cost", ["--requests", "20", "--concurrency", "4", "--cluster"], 90, check_limiter_cost
    ),
    case(
        "bench.tenancy_cost",
        ["--requests", "10", "--concurrency", "2", "--seconds", "0.5", "--cluster"],
        90,
        check_tenancy_cost,
    ),
    # An emulator and sluice serve pinned with taskset, flood processes; both access-log modes.
    case(
        "bench.rejection_flood",
        ["--duration", "1", "--workers", "1", "--connections", "4", "--access-log", "both"],
        120,
        check_rejection_flood,
    ),
    case(
        "bench.rejection_replay",
        ["--requests", "20", "--rounds", "1", "--warm", "2", "--access-log"],
        90,
        check_rejection_replay,
    ),
    case("bench.slowloris", ["--quick"], 60, check_slowloris),
    # The TGI emulator, two generate calls, then every scrape parsed once per parser.
    case("bench.scrape_parse", ["--rounds", "1", "--requests", "2"], 60, check_scrape_parse),
    # The fake backend, a redis-server and sluice serve under the collector-recording shim, 2 x 1 s.
    case("bench.gc_pauses", ["--quick"], 90, check_gc_pauses),
    # Virtual time, in process (one worker).
    case(
        "bench.goodput.ablation",
        ["--quick", "--loads", "1", "--variants", "0", "1", "--spike", "--forecast-accuracy", "--jobs", "1"],
        90,
        check_ablation,
    ),
    case("bench.predictor_accuracy", ["--quick", "--no-write"], 90, check_predictor_accuracy),
    case("bench.forecast_bound", ["--quick"], 60, check_forecast_bound),
    case(
        "bench.onset",
        [
            "--traces",
            "azure",
            "--seeds",
            "0",
            "--warm-s",
            "5",
            "--quiet-s",
            "5",
            "--duration",
            "10",
            "--jobs",
            "1",
        ],
        60,
        check_onset,
    ),
    # The fake backend, a redis-server, the stamped bare proxy and both sluice configurations.
    case("bench.overhead.timeline", ["--rounds", "1", "--duration", "0.5"], 120, check_timeline),
    # Two emulators, a redis-server and sluice serve under mixed load for 6 s.
    case(
        "bench.soak",
        ["--minutes", "0.1", "--clients", "2", "--sample-s", "1", "--warmup-s", "1", "--idle-s", "1"],
        90,
        check_soak,
    ),
]


@pytest.mark.timeout(900)  # a hung run's last stop; run_bench's own bound is the real one
@pytest.mark.parametrize(("module", "args", "timeout_s", "check"), CASES)
def test_bench_script_runs_its_tiny_configuration(
    module: str, args: list[str], timeout_s: float, check: Check
) -> None:
    check(run_bench(module, args, timeout_s))
