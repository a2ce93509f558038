"""AIPerf, the third-party load generator of the end-to-end bench: install, command line, results.

AIPerf (NVIDIA, PyPI ``aiperf``) is installed, pinned, into its own venv under
``.cache/bench/e2e/aiperf`` (it brings ~150 packages that must not touch the project's venv). One
``aiperf profile`` run is one tenant's load: streamed chat completions of synthetic prompts with
``ignore_eos`` (exact output lengths), sent open-loop at a request rate (Poisson arrivals) or
closed-loop at a concurrency, for a duration, then a grace period in which what is in flight may
finish. What the bench reads is AIPerf's own summary, ``profile_export_aiperf.json``: TTFT, ITL,
request throughput, goodput (requests meeting the TTFT and ITL targets given with ``--goodput``)
and the error summary, grouped by HTTP status.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "bench" / "e2e"
VENV = CACHE / "aiperf"
AIPERF_VERSION = "0.13.0"
SUMMARY = "profile_export_aiperf.json"


class Unavailable(RuntimeError):
    """AIPerf could not be installed or did not produce its results; the message says why."""


def _tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.strip().splitlines()[-lines:])


def installed_version(python: Path) -> str | None:
    """The ``aiperf`` distribution version in the venv of ``python``; None when it is absent."""
    if not python.exists():
        return None
    done = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('aiperf'))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def install(venv: Path = VENV) -> Path:
    """Install ``aiperf==AIPERF_VERSION`` into ``venv`` (once; instant when present); its ``aiperf``.

    Raises :class:`Unavailable` with the tail of pip's log when the install fails.
    """
    python = venv / "bin" / "python"
    if installed_version(python) == AIPERF_VERSION:
        return venv / "bin" / "aiperf"
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / "aiperf-install.log"
    with log.open("wb") as out:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, stdout=out, stderr=out)
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"aiperf=={AIPERF_VERSION}"],
            stdout=out,
            stderr=out,
            check=False,
        )
    if done.returncode != 0 or installed_version(python) != AIPERF_VERSION:
        raise Unavailable(f"pip install aiperf=={AIPERF_VERSION} failed (log {log}):\n{_tail(log)}")
    return venv / "bin" / "aiperf"


@dataclass(frozen=True)
class Load:
    """One tenant's load for one ``aiperf profile`` run.

    ``rate_per_s`` (requests per second, Poisson arrivals) makes it open-loop; ``None`` with
    ``concurrency`` makes it closed-loop (that many requests always in flight). Durations in
    seconds; prompt and output sizes in tokens of the served model's tokenizer.
    """

    rate_per_s: float | None
    concurrency: int | None
    duration_s: float
    grace_s: float
    isl: int
    osl: int
    seed: int
    #: Goodput targets, milliseconds: a request counts when its TTFT and mean ITL are within them.
    ttft_target_ms: float
    itl_target_ms: float


def request_bound(load: Load) -> int:
    """A request count the run does not reach before its duration ends: 1.5 times the expected
    arrivals plus 20 (open loop; five standard deviations of a Poisson count of 100), or 5 requests
    per second per slot (closed loop; the tiny model on an idle core does about 3)."""
    if load.rate_per_s is not None:
        return math.ceil(load.rate_per_s * load.duration_s * 1.5) + 20
    return math.ceil((load.concurrency or 1) * load.duration_s * 5) + 20


def command(
    binary: Path,
    *,
    urls: Sequence[str],
    model: str,
    tokenizer: Path,
    api_key: str,
    load: Load,
    artifacts: Path,
) -> list[str]:
    """The ``aiperf profile`` command line of one run (``urls``: round robin over them)."""
    goodput = f"time_to_first_token:{load.ttft_target_ms:g} inter_token_latency:{load.itl_target_ms:g}"
    args = [str(binary), "profile", "--model", model]
    for url in urls:
        args += ["--url", url]
    args += [
        "--endpoint-type", "chat",
        "--streaming",
        "--api-key", api_key,
        "--tokenizer", str(tokenizer),
        "--synthetic-input-tokens-mean", str(load.isl),
        "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(load.osl),
        "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true",
        "--benchmark-duration", f"{load.duration_s:g}",
        "--benchmark-grace-period", f"{load.grace_s:g}",
        "--random-seed", str(load.seed),
        "--goodput", goodput,
        "--artifact-dir", str(artifacts),
        "--ui-type", "none",
        "--no-gpu-telemetry",
        # The replicas' and Sluice's /metrics are not scraped: the two paths cost the same.
        "--no-server-metrics",
        # Few processes: the machine has 2 cores and the replicas need them.
        "--workers-max", "2",
        "--record-processors", "1",
    ]  # fmt: skip
    # AIPerf stops at whichever comes first, the duration or a request count, and its default
    # count is small (max(10, 2 x concurrency)): give it a bound the duration always reaches first.
    # Its synthetic dataset has that many conversations, and each costs a tokenizer pass at start:
    # the bound is kept tight (see request_bound).
    args += ["--request-count", str(request_bound(load))]
    if load.rate_per_s is not None:
        args += ["--request-rate", f"{load.rate_per_s:.4g}"]
    if load.concurrency is not None:
        args += ["--concurrency", str(load.concurrency)]
    return args


@dataclass
class Result:
    """What AIPerf reports for one run (times in milliseconds, rates in requests per second)."""

    requests: int
    errors: int
    #: Failed requests by HTTP status (``"429"``, ``"503"``...), or by error type when none.
    errors_by_status: dict[str, int]
    request_throughput: float
    goodput: float | None
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    #: When AIPerf started sending (its ``start_time``, ISO 8601, local time of the machine).
    start_time: str | None = None
    raw: dict[str, Any] = field(repr=False, default_factory=dict)


def _stats(summary: Mapping[str, Any], key: str) -> dict[str, float]:
    entry = summary.get(key)
    if not isinstance(entry, dict):
        return {}
    return {
        k: float(v) for k, v in entry.items() if k in {"avg", "p50", "p90", "p99", "max"} and v is not None
    }


def _scalar(summary: Mapping[str, Any], key: str) -> float | None:
    entry = summary.get(key)
    if isinstance(entry, dict) and entry.get("avg") is not None:
        return float(entry["avg"])
    return None


def errors_by_status(summary: Mapping[str, Any]) -> dict[str, int]:
    """AIPerf's ``error_summary`` grouped by HTTP status code (error type when there is none)."""
    out: dict[str, int] = {}
    for item in summary.get("error_summary") or []:
        details = item.get("error_details") or {}
        code = details.get("code")
        key = str(code) if code is not None else str(details.get("type") or "unknown")
        out[key] = out.get(key, 0) + int(item.get("count") or 0)
    return out


def parse(artifacts: Path) -> Result:
    """Read AIPerf's summary in ``artifacts`` (searched recursively); :class:`Unavailable` if absent."""
    found = sorted(artifacts.rglob(SUMMARY))
    if not found:
        raise Unavailable(f"aiperf wrote no {SUMMARY} under {artifacts}")
    summary = json.loads(found[0].read_text(encoding="utf-8"))
    by_status = errors_by_status(summary)
    requests = int(_scalar(summary, "request_count") or 0)
    errors = int(_scalar(summary, "error_request_count") or sum(by_status.values()))
    return Result(
        requests=requests,
        errors=errors,
        errors_by_status=by_status,
        request_throughput=_scalar(summary, "request_throughput") or 0.0,
        goodput=_scalar(summary, "goodput"),
        ttft_ms=_stats(summary, "time_to_first_token"),
        itl_ms=_stats(summary, "inter_token_latency"),
        start_time=summary.get("start_time"),
        raw=summary,
    )
