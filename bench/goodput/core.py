"""Goodput of five admission policies on real traces, replayed in virtual time.

``replay.run_gateway_replay`` replays a trace through a gateway policy in front of a fleet of
emulated vLLM engines (``simulator.engine``); Sluice's policy is the shipped ``AdmissionEngine``
and ``PredictionService`` driven as the live gateway drives them: prompts sent as text and sized
from their characters (``TEXT``), every request reserving and settling its tenant's budget
(``tenant_budgets``), the view cache and re-placement as live. For each trace the bench

1. measures one replica's capacity for the trace's length mix (``replay.measure_capacity``);
2. tunes each baseline's one knob for its best goodput at 1x load (a small grid, reported), and
   replays the same grids at 2x, where Sluice is compared with the best baseline;
3. replays every policy at 0.5x, 1x, 1.5x, 2x and 3x the fleet's capacity, and a spike
   (normal load, 3x for a while, normal again);
4. judges Sluice's targets (``verdicts``): met, not met, or not met for want of data;
5. writes the tables between the markers of ``docs/benchmarks.md`` and the plots to
   ``docs/img/`` (plots only when matplotlib, the ``bench`` extra, is installed).

Run: ``.venv/bin/python -m bench.goodput`` (``--quick``: a tiny configuration, seconds;
``--no-write``: print only; ``--jobs N``: worker processes; ``--traces azure``: one trace only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Final

from bench.goodput.metrics import (
    DispatchForecast,
    ForecastAccuracy,
    Score,
    attainment_series,
    forecast_accuracy,
    prompt_quartile_edges,
    recovery_time_s,
    rejections_stop_s,
    score,
    score_by_tenant,
)
from bench.shared import InProcess, write_block
from bench.verdicts import Status, Verdict, judge, missing
from gateway.admission import AdmissionSettings, ClassSettings, Decision
from gateway.limits.base import TenantLimits
from gateway.prediction import ReplicaFacts
from replay import (
    FleetConfig,
    GatewayPolicy,
    GatewayRequest,
    Outcome,
    PromptText,
    Targets,
    TraceRequest,
    fit_to_model_len,
    load_azure_trace,
    load_mooncake_trace,
    measure_capacity,
    piecewise_rate,
    run_gateway_replay,
)
from replay.baselines import ConcurrencyCap, NoAdmission, SaturationShedding, TenantRateLimit
from replay.policies import SluicePolicy
from simulator.profile import load_profile

PROFILE: Final = "llama3-8b-h100"
#: What an operator writes for one H100 serving Llama-3-8B with vLLM's defaults (never the profile).
FACTS: Final = ReplicaFacts(
    gpu="H100-SXM",
    model="meta-llama/Meta-Llama-3-8B-Instruct",
    tensor_parallel=1,
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    max_model_len=8192,
)
#: The interactive class's targets: TTFT from arrival at the gateway, mean TPOT after the first token.
#: Prompts reach the gateway as text: it sizes each from its characters at its learned ratio
#: (the trace's true tokens drive the engine).
TEXT: Final = PromptText()
#: Each tenant's token budget, as a multiple of its share of the fleet's capacity in tokens
#: (prompt + output: the gateway's default pricing): every Sluice request reserves and settles
#: through the limiter, and no budget binds below this multiple of capacity, so the comparison
#: stays one of admission.
BUDGET_HEADROOM: Final = 4.0

TTFT_TARGET_S: Final = 1.0
TPOT_TARGET_S: Final = 0.05
TARGETS: Final = Targets(TTFT_TARGET_S, TPOT_TARGET_S)

POLICIES: Final = ("none", "cap", "saturation", "gaie", "ratelimit", "sluice", "sluice-nobudget")
#: Sluice's rows: its default configuration (the interactive class's per-stream stall budget on,
#: ``INTERACTIVE_STALL_BUDGET_HORIZON``), and with the budget off (the default before it).
SLUICES: Final = ("sluice", "sluice-nobudget")
LABELS: Final = {
    "none": "(a) no admission",
    "cap": "(b) concurrency cap + FIFO",
    "saturation": "(c) saturation shedding, tuned",
    "gaie": "(c') saturation shedding, GAIE defaults",
    "ratelimit": "(d) tenant rpm/tpm",
    "sluice": "(e) Sluice",
    "sluice-nobudget": "(e') Sluice, stall budget off",
}
KNOBS: Final = {
    "cap": "outstanding requests per replica",
    "saturation": "KV-use threshold (queue threshold 5)",
    "ratelimit": "per-tenant limit, as a fraction of the fleet's capacity",
}
LOADS: Final = (0.5, 1.0, 1.5, 2.0, 3.0)
#: The load the baselines' knobs are tuned at for the results (each keeps its best knob there at
#: every load), and the load Sluice is compared with the best baseline at (where the knobs are
#: tuned again: the best of each grid there is a candidate).
TUNE_LOAD: Final = 1.0
COMPARE_LOAD: Final = 2.0
#: Sluice's targets: goodput at 2x and 3x >= 90 % of Sluice's own at 1x; at 2x >= 1.3x the
#: best baseline's; wasted GPU time < 2 % at every load; recovery within 5 s of the spike's end.
OWN_RATIO: Final = 0.9
BASELINE_RATIO: Final = 1.3
WASTE_BOUND: Final = 0.02
RECOVERY_BOUND_S: Final = 5.0
#: No starvation by size: at ``COMPARE_LOAD``, the longest prompt quartile's share served at
#: least this fraction of the shortest's.
SIZE_RATIO: Final = 1.0 / 3.0
TRACES: Final = ("azure", "mooncake")

DOC: Final = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
IMG: Final = DOC.parent / "img"
BEGIN, END = "<!-- goodput:begin (generated by bench/goodput) -->", "<!-- goodput:end -->"


@dataclass(frozen=True, slots=True)
class Plan:
    """Sizes of one run (virtual seconds unless stated)."""

    replicas: int = 2
    warmup_s: float = 30.0
    measure_s: float = 60.0
    cooldown_s: float = 30.0
    normal_load: float = 0.8
    spike_load: float = 3.0
    pre_s: float = 30.0
    spike_s: float = 60.0
    post_s: float = 60.0
    grids: tuple[tuple[str, tuple[float, ...]], ...] = (
        ("cap", (32, 64, 96, 128, 192, 256)),
        ("saturation", (0.15, 0.2, 0.25, 0.3, 0.4, 0.8)),
        ("ratelimit", (0.6, 0.7, 0.8, 0.9, 1.0, 1.2)),
    )
    loads: tuple[float, ...] = LOADS
    #: Loads the baselines' grids are replayed at: ``TUNE_LOAD`` chooses the knob each keeps in
    #: the results; at ``COMPARE_LOAD`` the best of every grid is a candidate for the best baseline.
    tune_loads: tuple[float, ...] = (TUNE_LOAD, COMPARE_LOAD)
    traces: tuple[str, ...] = TRACES
    capacity_rows: int = 4000
    seed: int = 0
    #: Width of the attainment windows that decide the recovery after the spike (seconds), and
    #: how long before the spike the pre-spike windows must end, and the share of the pre-spike
    #: level that counts as recovered.
    recovery_window_s: int = 5
    recovery_guard_s: float = 10.0
    recovery_tolerance: float = 0.9


QUICK: Final = Plan(
    replicas=1,
    warmup_s=2.0,
    measure_s=4.0,
    cooldown_s=1.0,
    pre_s=4.0,
    spike_s=3.0,
    post_s=6.0,
    grids=(("cap", (64, 128)), ("saturation", (0.25, 0.8)), ("ratelimit", (0.8, 1.0))),
    traces=("azure",),
    capacity_rows=400,
    recovery_window_s=2,
    recovery_guard_s=1.0,
)


@cache
def trace_requests(name: str) -> tuple[tuple[TraceRequest, ...], int]:
    """(the trace's requests that fit the profile's ``max_model_len``, how many did not)."""
    raw = load_azure_trace() if name == "azure" else load_mooncake_trace()
    kept, too_long = fit_to_model_len(raw, load_profile(PROFILE).engine.max_model_len)
    return tuple(kept), too_long


@cache
def trace_prompt_edges(name: str) -> tuple[int, int, int]:
    """The prompt-size quartile edges (tokens) over every request of the trace that fits, the same
    for every cell of the trace whatever its load or policy (``prompt_quartile_edges``)."""
    return prompt_quartile_edges(r.prompt_tokens for r in trace_requests(name)[0])


def admission_settings(overrides: Sequence[tuple[str, float | None]] = ()) -> AdmissionSettings:
    """Sluice's configuration: the shipped interactive class (its stall budget included) with the
    targets above, defaults otherwise.

    ``overrides``: (key, value) pairs for the ablation (``bench.goodput.ablation``): a key of the
    ``admission`` section (``forecast_margin``...) or ``class.<key>`` for the interactive class,
    ``class.<section>.<key>`` for one key of a class's sub-section (``size_fairness``), the rest
    of that sub-section at its defaults (``None``: the setting off, where it may be null).
    """
    section: dict[str, float | None] = {}
    cls: dict[str, object] = {}
    for key, value in overrides:
        if key.startswith("class."):
            name, _, sub = key.removeprefix("class.").partition(".")
            if sub:
                nested = cls.setdefault(name, {})
                assert isinstance(nested, dict)
                nested[sub] = value
            else:
                cls[name] = value
        else:
            section[key] = value
    shipped = AdmissionSettings().classes["interactive"].model_dump()
    interactive = ClassSettings.model_validate(
        {
            **shipped,
            "ttft_target_s": TTFT_TARGET_S,
            "tpot_target_s": TPOT_TARGET_S,
            "max_queue_wait_s": TTFT_TARGET_S,
            **cls,
        }
    )
    return AdmissionSettings.model_validate(
        {"classes": {"interactive": interactive}, "default_class": "interactive", **section}
    )


@dataclass(frozen=True, slots=True)
class CellSpec:
    """One replay: a trace, a policy with its knob, load phases (multiples of fleet capacity)."""

    trace: str
    policy: str
    knob: float | None
    phases: tuple[tuple[float, float], ...]
    scored: tuple[float, float]
    capacity: float  # requests/s per replica
    mean_tokens: float  # prompt + output per request, for the rate limiter's tpm
    replicas: int
    seed: int
    spike: tuple[float, float] | None = None  # (start, end) of the spike phase
    recovery_window_s: int = 5
    recovery_guard_s: float = 10.0
    recovery_tolerance: float = 0.9
    #: Sluice settings changed from ``admission_settings()`` (the ablation only).
    sluice_overrides: tuple[tuple[str, float | None], ...] = ()
    #: Also score Sluice's dispatch forecasts against what its requests measured
    #: (``CellResult.accuracy``; Sluice's policies only, decisions unchanged).
    forecast_accuracy: bool = False


@dataclass(frozen=True, slots=True)
class CellResult:
    spec: CellSpec
    score: Score
    seconds: float
    series: tuple[tuple[float, int, int, int], ...] = ()
    recovery_s: float | None = None
    rejections_stop_s: float | None = None
    extra: dict[str, float] = field(default_factory=dict)
    #: Sluice's forecast errors over the scored requests (``spec.forecast_accuracy`` only).
    accuracy: ForecastAccuracy | None = None
    #: Each tenant's own score over the scored requests (``score_by_tenant``).
    by_tenant: Mapping[str, Score] = field(default_factory=dict)


class ForecastRecorder(SluicePolicy):
    """Sluice's policy, every decision its own, that also keeps each dispatched request's forecast.

    ``forecasts``: by request index, the forecast the admission decision carried when the request
    was sent (what the live gateway's ``x-sluice-predicted-*`` headers show, less the dispatch
    overhead the replay does not learn), with admission's margins divided out again, so that it is
    the predictor's own (``DispatchForecast``). Observation only: it reads the decision and the
    views the decision was made on, and changes neither.
    """

    def __init__(
        self,
        settings: AdmissionSettings,
        *,
        seed: int = 0,
        name: str = "sluice",
        budgets: Mapping[str, TenantLimits] | None = None,
    ) -> None:
        super().__init__(settings, seed=seed, name=name, budgets=budgets)
        self._fresh_scale = 1.0 + settings.forecast_margin
        self._stale_scale = self._fresh_scale * (1.0 + settings.stale_margin)
        self.forecasts: dict[int, DispatchForecast] = {}

    def on_decision(self, request: GatewayRequest, decision: Decision, now: float) -> None:
        forecast = decision.forecast
        if decision.admits and forecast is not None and decision.replica is not None:
            view = self.engine.cached_view(self.route, decision.replica)
            stale = view is not None and view.stale
            scale = self._stale_scale if stale else self._fresh_scale
            self.forecasts[request.index] = DispatchForecast(
                forecast.ttft_s / scale, forecast.tpot_s / scale, scale, stale
            )


def tenant_budgets(spec: CellSpec) -> dict[str, TenantLimits]:
    """Every tenant's budget for ``spec``'s fleet (``BUDGET_HEADROOM``); tenants ``t0``.. as
    ``replay.gateway_requests`` names them."""
    tenants = FleetConfig(load_profile(PROFILE), FACTS).tenants
    per_minute = BUDGET_HEADROOM * spec.capacity * spec.replicas * 60.0 * spec.mean_tokens / tenants
    return {f"t{i}": TenantLimits(tokens_per_minute=per_minute) for i in range(tenants)}


def make_policy(spec: CellSpec) -> GatewayPolicy:
    """The policy a cell names, its knob applied."""
    fleet_capacity = spec.capacity * spec.replicas
    if spec.policy == "none":
        return NoAdmission()
    if spec.policy == "cap":
        assert spec.knob is not None
        return ConcurrencyCap(int(spec.knob), queue_timeout_s=TTFT_TARGET_S)
    if spec.policy == "gaie":
        return SaturationShedding()  # queue > 5, KV > 0.8: not tuned
    if spec.policy == "saturation":
        return SaturationShedding(queue_threshold=5, kv_threshold=0.8 if spec.knob is None else spec.knob)
    if spec.policy == "ratelimit":
        assert spec.knob is not None
        tenants = FleetConfig(load_profile(PROFILE), FACTS).tenants
        rpm = spec.knob * fleet_capacity * 60.0 / tenants
        return TenantRateLimit(rpm, rpm * spec.mean_tokens, label=f"rate limit {spec.knob:g}x")
    sluice = ForecastRecorder if spec.forecast_accuracy else SluicePolicy
    budgets = tenant_budgets(spec)
    if spec.policy == "sluice":
        return sluice(admission_settings(spec.sluice_overrides), seed=spec.seed, budgets=budgets)
    if spec.policy == "sluice-nobudget":
        overrides = (("class.stall_budget_horizon", None), *spec.sluice_overrides)
        return sluice(admission_settings(overrides), seed=spec.seed, name="sluice-nobudget", budgets=budgets)
    raise ValueError(f"unknown policy {spec.policy!r}")


def run_cell(spec: CellSpec) -> CellResult:
    """Replay one cell and score it (runs in a worker process)."""
    started = time.perf_counter()
    trace, _ = trace_requests(spec.trace)
    fleet_capacity = spec.capacity * spec.replicas
    phases = [(d, load * fleet_capacity) for d, load in spec.phases]
    arrivals = piecewise_rate(trace, phases)
    total = sum(d for d, _ in spec.phases)
    if not arrivals or arrivals[-1].arrival_s < spec.scored[1]:
        raise RuntimeError(f"{spec.trace}: not enough requests for {total:.0f} s at these loads")
    config = FleetConfig(load_profile(PROFILE), FACTS, replicas=spec.replicas, seed=spec.seed, text=TEXT)
    policy = make_policy(spec)
    result = run_gateway_replay(arrivals, config, policy, targets=TARGETS, scored=spec.scored)
    first, last = spec.scored
    scored = [o for o in result.outcomes if first <= o.arrival_s < last]
    cell = score(scored, TARGETS, last - first, trace_prompt_edges(spec.trace))
    extra = diagnosis(scored)
    if isinstance(policy, SluicePolicy):
        for (reason, blocker), n in sorted(policy.refusals.items()):
            extra[f"refused {reason}/{blocker}"] = float(n)
    accuracy = forecast_accuracy(scored, policy.forecasts) if isinstance(policy, ForecastRecorder) else None
    by_tenant = score_by_tenant(scored, TARGETS, last - first)
    if spec.spike is None:
        return CellResult(
            spec, cell, time.perf_counter() - started, extra=extra, accuracy=accuracy, by_tenant=by_tenant
        )
    series = attainment_series(scored, TARGETS, first, last)
    start, end = spec.spike
    return CellResult(
        spec,
        cell,
        time.perf_counter() - started,
        tuple(series),
        recovery_time_s(
            series,
            start,
            end,
            window_s=spec.recovery_window_s,
            guard_s=spec.recovery_guard_s,
            tolerance=spec.recovery_tolerance,
        ),
        rejections_stop_s(series, end),
        extra,
        accuracy,
        by_tenant,
    )


def diagnosis(scored: Sequence[Outcome]) -> dict[str, float]:
    """Why requests missed or were refused: counts and sizes over the scored requests."""
    served = [o for o in scored if o.served]
    missed = [o for o in served if not o.met(TARGETS)]
    met = [o for o in served if o.met(TARGETS)]
    refused = [o for o in scored if o.rejected]

    def ttft_missed(o: Outcome) -> bool:
        return o.ttft_s is None or o.ttft_s > TTFT_TARGET_S

    def median(xs: Sequence[float]) -> float:
        return float(statistics.median(xs)) if xs else math.nan

    def mean(xs: Sequence[float]) -> float:
        return float(statistics.fmean(xs)) if xs else math.nan

    return {
        "unfinished": float(sum(1 for o in served if o.finished_s is None)),
        "served": float(len(served)),
        "missed ttft": float(sum(1 for o in missed if ttft_missed(o))),
        "missed tpot only": float(sum(1 for o in missed if not ttft_missed(o))),
        "missed output median": median([o.output_tokens for o in missed]),
        "met output median": median([o.output_tokens for o in met]),
        "refused prompt mean": mean([o.prompt_tokens for o in refused]),
        "served prompt mean": mean([o.prompt_tokens for o in served]),
    }


def steady(
    trace: str, policy: str, knob: float | None, load: float, plan: Plan, capacity: float, mean: float
) -> CellSpec:
    return CellSpec(
        trace,
        policy,
        knob,
        ((plan.warmup_s + plan.measure_s + plan.cooldown_s, load),),
        (plan.warmup_s, plan.warmup_s + plan.measure_s),
        capacity,
        mean,
        plan.replicas,
        plan.seed,
    )


def spike(trace: str, policy: str, knob: float | None, plan: Plan, capacity: float, mean: float) -> CellSpec:
    start = plan.warmup_s + plan.pre_s
    end = start + plan.spike_s
    return CellSpec(
        trace,
        policy,
        knob,
        (
            (start, plan.normal_load),
            (plan.spike_s, plan.spike_load),
            (plan.post_s + plan.cooldown_s, plan.normal_load),
        ),
        (plan.warmup_s, end + plan.post_s),
        capacity,
        mean,
        plan.replicas,
        plan.seed,
        (start, end),
        plan.recovery_window_s,
        plan.recovery_guard_s,
        plan.recovery_tolerance,
    )


@dataclass(slots=True)
class TraceRun:
    """Everything measured on one trace."""

    trace: str
    capacity: float
    too_long: int
    kept: int
    mean_prompt: float
    mean_output: float
    #: The loads the plan replays every policy at (the waste target's "every load").
    loads: tuple[float, ...] = ()
    tuning: list[CellResult] = field(default_factory=list)
    knobs: dict[str, float] = field(default_factory=dict)
    cells: list[CellResult] = field(default_factory=list)
    spikes: list[CellResult] = field(default_factory=list)
    #: The trace's prompt-size quartile edges in tokens (``trace_prompt_edges``).
    prompt_edges: tuple[int, int, int] = (0, 0, 0)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _describe(c: CellResult) -> str:
    s = c.score
    return (
        f"{c.spec.trace} {c.spec.policy}({c.spec.knob}) phases={c.spec.phases}: goodput {s.goodput:.2f}/s "
        f"of {s.offered_rate:.2f}, attainment {s.attainment:.3f}, rejected {s.rejection_rate:.3f}, "
        f"wasted {100 * s.wasted:.1f} %, {c.seconds:.1f} s"
    )


def run(plan: Plan, jobs: int) -> list[TraceRun]:
    """Capacity, tuning, the load grid and the spike on every trace of ``plan``."""
    runs: list[TraceRun] = []
    profile = load_profile(PROFILE)
    for name in plan.traces:
        trace, too_long = trace_requests(name)
        capacity = measure_capacity(profile, trace[: plan.capacity_rows], seed=plan.seed)
        mean_prompt = sum(r.prompt_tokens for r in trace) / len(trace)
        mean_output = sum(r.output_tokens for r in trace) / len(trace)
        runs.append(
            TraceRun(
                name,
                capacity,
                too_long,
                len(trace),
                mean_prompt,
                mean_output,
                tuple(plan.loads),
                prompt_edges=trace_prompt_edges(name),
            )
        )
        _log(
            f"{name}: capacity {capacity:.2f} req/s per replica; "
            f"{too_long} requests over max_model_len left out"
        )
    with ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else InProcess() as pool:
        specs = [
            steady(r.trace, policy, knob, load, plan, r.capacity, r.mean_prompt + r.mean_output)
            for r in runs
            for load in plan.tune_loads
            for policy, grid in plan.grids
            for knob in grid
        ]
        for res in pool.map(run_cell, specs):
            _log("tune " + _describe(res))
            tr = next(r for r in runs if r.trace == res.spec.trace)
            tr.tuning.append(res)
        for tr in runs:
            for policy, _ in plan.grids:
                options = [
                    c for c in tr.tuning if c.spec.policy == policy and math.isclose(_load_of(c), TUNE_LOAD)
                ]
                best = max(options, key=lambda c: (c.score.goodput, -options.index(c)))
                assert best.spec.knob is not None
                tr.knobs[policy] = best.spec.knob
        specs = []
        for tr in runs:
            mean = tr.mean_prompt + tr.mean_output
            # The slowest cells (Sluice at overload, the spikes) first, so the pool ends together.
            for policy in (*SLUICES, *[p for p in POLICIES if p not in SLUICES]):
                specs.append(spike(tr.trace, policy, tr.knobs.get(policy), plan, tr.capacity, mean))
                for load in sorted(plan.loads, reverse=True):
                    specs.append(
                        steady(tr.trace, policy, tr.knobs.get(policy), load, plan, tr.capacity, mean)
                    )
        for res in pool.map(run_cell, specs):
            _log(("spike " if res.spec.spike else "cell ") + _describe(res))
            tr = next(r for r in runs if r.trace == res.spec.trace)
            (tr.spikes if res.spec.spike else tr.cells).append(res)
    return runs


# -- reporting -----------------------------------------------------------------------------------------


def _load_of(c: CellResult) -> float:
    return c.spec.phases[0][1]


def _cell(tr: TraceRun, policy: str, load: float) -> CellResult | None:
    for c in tr.cells:
        if c.spec.policy == policy and math.isclose(_load_of(c), load):
            return c
    return None


def _knob_text(policy: str, knob: float | None) -> str:
    if policy == "gaie":
        return "queue > 5, KV > 0.8"
    if knob is None:
        return "-"
    if policy == "cap":
        return f"{knob:.0f}"
    if policy == "ratelimit":
        return f"{knob:g}x capacity"
    return f"KV > {knob:g}"


def _percent(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.0f}"


def quartile_text(s: Score) -> str:
    """Refused / offered per prompt-size quartile, shortest first, as ``"0 / 1 / 3 / 40 %"``
    ("-" for a quartile with no request; "not measured" without quartiles)."""
    if s.by_prompt is None:
        return "not measured"
    return " / ".join(_percent(x) for x in s.by_prompt.rates) + " %"


def quartile_legend(edges: tuple[int, int, int]) -> str:
    """The quartiles' prompt sizes in words: ``"Q1 <= 300, Q2 <= 800, Q3 <= 1,500, Q4 > 1,500 tokens"``."""
    a, b, c = edges
    return f"Q1 <= {a:,}, Q2 {a + 1:,}-{b:,}, Q3 {b + 1:,}-{c:,}, Q4 > {c:,} tokens"


def results_table(tr: TraceRun) -> str:
    """Goodput (requests and tokens) / attainment / rejection (overall and per prompt-size
    quartile) / waste per policy and load."""
    rows = [
        "| policy | knob | load | offered req/s | goodput req/s | good ktok/s (prompt + output) "
        "| attainment | rejected | not served by prompt quartile Q1 / Q2 / Q3 / Q4 | GPU time wasted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for policy in POLICIES:
        for load in sorted({_load_of(c) for c in tr.cells}):
            c = _cell(tr, policy, load)
            if c is None:
                continue
            s = c.score
            rows.append(
                f"| {LABELS[policy]} | {_knob_text(policy, c.spec.knob)} | {load:g}x | "
                f"{s.offered_rate:.1f} | {s.goodput:.1f} | {s.token_goodput / 1e3:.1f} | "
                f"{100 * s.attainment:.1f} % | {100 * s.rejection_rate:.1f} % | {quartile_text(s)} | "
                f"{100 * s.wasted:.1f} % |"
            )
    return "\n".join(rows) + "\n"


def tenant_table(tr: TraceRun, policy: str = "sluice") -> str:
    """``policy``'s goodput per tenant at each load: requests per second that met both targets
    and their attainment, per tenant, and the lowest tenant goodput over the highest ("-" when a
    tenant has none)."""
    cells = sorted((c for c in tr.cells if c.spec.policy == policy and c.by_tenant), key=_load_of)
    tenants = sorted({name for c in cells for name in c.by_tenant})
    if not cells:
        return f"No {LABELS.get(policy, policy)} cell scored per tenant.\n"
    rows = [
        "| load | "
        + " | ".join(f"{name}: goodput req/s (attainment)" for name in tenants)
        + " | lowest / highest |",
        "|---:|" + "---:|" * (len(tenants) + 1),
    ]
    for c in cells:
        scores = [c.by_tenant.get(name) for name in tenants]
        texts = ["-" if s is None else f"{s.goodput:.2f} ({100 * s.attainment:.0f} %)" for s in scores]
        goodputs = [s.goodput for s in scores if s is not None]
        spread = "-" if not goodputs or max(goodputs) <= 0 else f"{min(goodputs) / max(goodputs):.2f}"
        rows.append(f"| {_load_of(c):g}x | " + " | ".join(texts) + f" | {spread} |")
    return "\n".join(rows) + "\n"


def tuning_table(tr: TraceRun) -> str:
    """Every tuning cell; "chosen": the knob kept for the results (best at ``TUNE_LOAD``), "best":
    the best of its grid at another load."""
    rows = [
        "| policy | knob | load | goodput (req/s) | attainment | rejected | chosen |",
        "|---|---|---:|---:|---:|---:|:---:|",
    ]
    best: dict[tuple[str, float], float] = {}
    for c in tr.tuning:
        key = (c.spec.policy, _load_of(c))
        best[key] = max(best.get(key, -math.inf), c.score.goodput)
    for c in sorted(tr.tuning, key=_load_of):
        s, p, load = c.score, c.spec.policy, _load_of(c)
        if math.isclose(load, TUNE_LOAD):
            chosen = "yes" if tr.knobs.get(p) == c.spec.knob else ""
        else:
            chosen = "best" if s.goodput == best[(p, load)] else ""
        rows.append(
            f"| {LABELS[p]} | {_knob_text(p, c.spec.knob)} | {load:g}x | {s.goodput:.2f} | "
            f"{100 * s.attainment:.1f} % | {100 * s.rejection_rate:.1f} % | {chosen} |"
        )
    return "\n".join(rows) + "\n"


def spike_table(tr: TraceRun) -> str:
    rows = [
        "| policy | attainment over the span | rejected | recovery after the spike | rejections stop after |",
        "|---|---:|---:|---:|---:|",
    ]
    for policy in POLICIES:
        c = next((x for x in tr.spikes if x.spec.policy == policy), None)
        if c is None:
            continue
        rec = "not within the span" if c.recovery_s is None else f"{c.recovery_s:.0f} s"
        stop = "-" if c.rejections_stop_s is None else f"{c.rejections_stop_s:.0f} s"
        rows.append(
            f"| {LABELS[policy]} | {100 * c.score.attainment:.1f} % | {100 * c.score.rejection_rate:.1f} % | "
            f"{rec} | {stop} |"
        )
    return "\n".join(rows) + "\n"


def _goodput_text(c: CellResult | None) -> str:
    return "not measured" if c is None else f"{c.score.goodput:.1f} req/s"


def _ratio_verdict(
    target: str,
    num: CellResult | None,
    den: CellResult | None,
    bound: float,
    names: tuple[str, str],
    *,
    percent: bool = False,
) -> Verdict:
    """``num``'s goodput / ``den``'s >= ``bound``, or ``NO_DATA``: a cell missing, or a ``den``
    with no goodput (a ratio against nothing proves nothing). ``names``: how the detail calls
    ``num`` and ``den``; ``percent``: the ratio printed as a percentage, else as ``1.23x``."""
    if num is None or den is None:
        return missing(
            target,
            f"{names[0]} {_goodput_text(num)}, {names[1]} {_goodput_text(den)}: a cell is missing",
        )
    g, base = num.score.goodput, den.score.goodput
    if not base > 0:
        return missing(
            target,
            f"{names[0]} {g:.1f} req/s, {names[1]} {base:.1f} req/s: a ratio against no goodput "
            "proves nothing",
        )
    ratio = g / base
    shown = f"{100 * ratio:.0f} %" if percent else f"{ratio:.2f}x"
    return judge(target, ratio, ratio >= bound, f"{g:.1f} vs {base:.1f} req/s = {shown}")


def best_baseline(tr: TraceRun, load: float) -> CellResult | None:
    """The baseline cell with the most goodput at ``load`` (``None`` when none was measured there):
    over the results' cells (knobs tuned at ``TUNE_LOAD``) and the tuning cells at ``load`` (every
    knob of each grid), so that a baseline tuned at ``load`` is the one compared when it was."""
    pool = [
        c
        for c in (*tr.cells, *tr.tuning)
        if c.spec.policy not in SLUICES
        and math.isclose(_load_of(c), load)
        and not math.isnan(c.score.goodput)
    ]
    return max(pool, key=lambda c: c.score.goodput, default=None)


def verdicts(tr: TraceRun, sluice: str = "sluice") -> list[Verdict]:
    """The targets for one of Sluice's rows on this trace, every one of them, always.

    A target whose cells are missing (or whose baseline produced no goodput) is ``NO_DATA``; the
    comparison with the best baseline says the loads the baselines' knobs were tuned at.
    """
    out: list[Verdict] = []
    base = _cell(tr, sluice, 1.0)
    for load in (2.0, 3.0):
        target = f"goodput at {load:g}x >= {100 * OWN_RATIO:.0f} % of its own at 1x"
        names = (f"at {load:g}x", "at 1x")
        out.append(_ratio_verdict(target, _cell(tr, sluice, load), base, OWN_RATIO, names, percent=True))

    at = COMPARE_LOAD
    tuned = sorted({_load_of(c) for c in tr.tuning})
    tuned_text = " and ".join(f"{x:g}x" for x in tuned) if tuned else "no load (no tuning cells)"
    target = f"goodput at {at:g}x >= {BASELINE_RATIO:g}x the best baseline's at {at:g}x"
    best = best_baseline(tr, at)
    if best is None:
        out.append(missing(target, f"no baseline measured at {at:g}x (knobs tuned at {tuned_text})"))
    else:
        who = f"{LABELS[best.spec.policy]}, {_knob_text(best.spec.policy, best.spec.knob)}"
        names = ("Sluice", "best baseline")
        v = _ratio_verdict(target, _cell(tr, sluice, at), best, BASELINE_RATIO, names)
        out.append(replace(v, detail=f"{v.detail}; best baseline {who}, knobs tuned at {tuned_text}"))

    target = f"GPU time wasted on requests that miss < {100 * WASTE_BOUND:.0f} % at every load"
    loads = sorted({*tr.loads, *(_load_of(c) for c in tr.cells)})
    own = {x: _cell(tr, sluice, x) for x in loads}
    absent = [f"{x:g}x" for x, c in own.items() if c is None]
    if not loads or absent:
        out.append(missing(target, f"no cell at {', '.join(absent) or 'any load'}"))
    else:
        worst = max((c for c in own.values() if c is not None), key=lambda c: c.score.wasted)
        w = worst.score.wasted
        detail = f"worst {100 * w:.1f} % (at {_load_of(worst):g}x)"
        out.append(judge(target, w, w < WASTE_BOUND, detail))

    target = f"recovers within {RECOVERY_BOUND_S:g} s after the spike"
    sp = next((x for x in tr.spikes if x.spec.policy == sluice), None)
    if sp is None:
        out.append(missing(target, "no spike cell"))
    elif sp.recovery_s is None:
        out.append(Verdict(target, Status.NOT_MET, "never within the span"))
    else:
        rec = sp.recovery_s
        out.append(judge(target, rec, rec <= RECOVERY_BOUND_S, f"{rec:.0f} s"))
    out.append(size_verdict(_cell(tr, sluice, COMPARE_LOAD)))
    return out


def size_verdict(c: CellResult | None) -> Verdict:
    """No starvation by size on ``c`` (Sluice at ``COMPARE_LOAD``): the longest prompt quartile's
    share served over the shortest's >= ``SIZE_RATIO``; ``NO_DATA`` without the cell, its quartiles, or
    any shortest prompt served."""
    target = f"longest prompt quartile served at {COMPARE_LOAD:g}x >= {SIZE_RATIO:.2g} of the shortest's rate"
    q = None if c is None else c.score.by_prompt
    if q is None:
        return missing(target, "no cell or no quartiles at that load")
    served = [1.0 - r for r in q.rates]
    if not served[0] > 0:
        return missing(target, "no request of the shortest quartile served: a ratio against nothing")
    ratio = served[3] / served[0]
    return judge(
        target, ratio, ratio >= SIZE_RATIO, f"{100 * served[3]:.0f} vs {100 * served[0]:.0f} % = {ratio:.2f}"
    )


def targets_check(tr: TraceRun, sluice: str = "sluice") -> str:
    """``verdicts`` as markdown: a heading with the row's label, one line per target."""
    lines = [f"{LABELS[sluice]}:", "", *(v.line() for v in verdicts(tr, sluice))]
    return "\n".join(lines) + "\n"


def plots(runs: Sequence[TraceRun], plan: Plan, suffix: str, img: Path = IMG) -> list[Path]:
    """goodput-vs-load (requests and good tokens per second) and spike-timeline PNGs; [] when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return []
    img.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 8.5), squeeze=False, sharex="col")
    for k, tr in enumerate(runs):
        ax, tok = axes[0][k], axes[1][k]
        for policy in POLICIES:
            cells = sorted((c for c in tr.cells if c.spec.policy == policy), key=_load_of)
            xs = [_load_of(c) for c in cells]
            ax.plot(xs, [c.score.goodput for c in cells], marker="o", label=LABELS[policy])
            tok.plot(xs, [c.score.token_goodput / 1e3 for c in cells], marker="o", label=LABELS[policy])
        loads = sorted({_load_of(c) for c in tr.cells})
        fleet = tr.capacity * plan.replicas
        ax.plot(loads, [x * fleet for x in loads], color="grey", linestyle=":", label="offered")
        ax.set_title(f"{tr.trace} trace, {plan.replicas} x {PROFILE}")
        ax.set_ylabel("goodput (req/s meeting TTFT and TPOT)")
        tok.set_ylabel("good ktok/s (prompt + output of those)")
        tok.set_xlabel("offered load (x fleet capacity)")
        for a in (ax, tok):
            a.set_ylim(bottom=0)
            a.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = img / f"goodput-vs-load{suffix}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 6.5), squeeze=False, sharex="col")
    for k, tr in enumerate(runs):
        for policy in POLICIES:
            c = next((x for x in tr.spikes if x.spec.policy == policy), None)
            if c is None or not c.series:
                continue
            xs = [s for s, *_ in c.series]
            axes[0][k].plot(
                xs, [m / o if o else math.nan for _, o, m, _ in c.series], label=LABELS[policy], lw=1
            )
            axes[1][k].plot(
                xs, [r / o if o else math.nan for _, o, _, r in c.series], label=LABELS[policy], lw=1
            )
            start, end = c.spec.spike or (0.0, 0.0)
            for ax in (axes[0][k], axes[1][k]):
                ax.axvspan(start, end, color="orange", alpha=0.08)
        axes[0][k].set_title(
            f"spike, {tr.trace} trace: {plan.normal_load:g}x -> {plan.spike_load:g}x -> {plan.normal_load:g}x"
        )
        axes[0][k].set_ylabel("attainment per second")
        axes[1][k].set_ylabel("rejected per second (fraction)")
        axes[1][k].set_xlabel("arrival time (virtual s)")
        for ax in (axes[0][k], axes[1][k]):
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = img / f"goodput-spike{suffix}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def _versions() -> str:
    import numpy

    parts = [f"Python {platform.python_version()}", f"numpy {numpy.__version__}"]
    try:
        import matplotlib

        parts.append(f"matplotlib {matplotlib.__version__}")
    except ImportError:
        parts.append("matplotlib not installed")
    return ", ".join(parts)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPUs visible"


def _load_average() -> str:
    """The machine's load average (1, 5, 15 minutes), or "unknown" where the OS has none."""
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def report(
    runs: Sequence[TraceRun],
    plan: Plan,
    command: str,
    images: Sequence[Path],
    seconds: float,
    doc: Path = DOC,
) -> str:
    """The generated part of docs/benchmarks.md."""
    out = [
        BEGIN,
        "",
        f"Command: `{command}` ({seconds / 60:.0f} min wall on the machine below; all virtual time).",
        "",
        f"Machine: {_machine()}. Versions: {_versions()}. Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. "
        f"Load average at the end (1, 5, 15 min): {_load_average()}.",
        "",
        f"Fleet: {plan.replicas} x `{PROFILE}` (emulated vLLM: 1 H100, `max_num_seqs` 1024, 8192 batched "
        f"tokens, `max_model_len` 8192). Targets: TTFT <= {TTFT_TARGET_S:g} s from arrival at the gateway, "
        f"mean TPOT <= {1e3 * TPOT_TARGET_S:g} ms. Each steady cell: {plan.warmup_s:g} s warm-up, "
        f"{plan.measure_s:g} s scored, {plan.cooldown_s:g} s more arrivals. Spike: {plan.normal_load:g}x for "
        f"{plan.warmup_s + plan.pre_s:g} s ({plan.pre_s:g} s scored), "
        f"{plan.spike_load:g}x for {plan.spike_s:g} s, "
        f"{plan.normal_load:g}x for {plan.post_s:g} s scored, then {plan.cooldown_s:g} s unscored.",
        "",
    ]
    for tr in runs:
        out += [
            f"### {tr.trace} trace",
            "",
            f"{tr.kept} requests fit `max_model_len` ({tr.too_long} longer ones left out, as vLLM "
            f"would answer them 400); mean prompt {tr.mean_prompt:.0f} tokens, "
            f"mean output {tr.mean_output:.0f}. Capacity "
            f"(saturation, `measure_capacity`): {tr.capacity:.2f} req/s per replica, "
            f"{tr.capacity * plan.replicas:.2f} for the fleet.",
            "",
            f"Baselines tuned at {TUNE_LOAD:g}x (best goodput chosen, then kept for every load of the "
            f"results) and at {COMPARE_LOAD:g}x (the best of each grid there is a candidate for the "
            f"best baseline Sluice is compared with at {COMPARE_LOAD:g}x):",
            "",
            tuning_table(tr),
            "Results. *good ktok/s*: prompt + output tokens of the scored requests that met both "
            "targets, per second of the scored span. *Not served by prompt quartile*: per quartile "
            "of prompt size, the share of its scored requests never served (rejected by the gateway, "
            "expired in its queue, or refused by a replica and not placed again); the quartiles are "
            f"cut once over all {tr.kept:,} requests of the trace ({quartile_legend(tr.prompt_edges)}), "
            "so every policy and load is binned alike.",
            "",
            results_table(tr),
            f"Per tenant ({LABELS['sluice']}): the trace's requests go to its tenants round robin, "
            "each with a token budget of "
            f"{BUDGET_HEADROOM:g}x its share of the fleet's capacity in plain tokens (prompt + output, "
            "the gateway's default pricing), reserved and settled through the gateway's limiter.",
            "",
            tenant_table(tr),
            f"Spike ({plan.normal_load:g}x -> {plan.spike_load:g}x for {plan.spike_s:g} s -> "
            f"{plan.normal_load:g}x):",
            "",
            spike_table(tr),
            "Sluice's targets on this trace:",
            "",
            *(targets_check(tr, s) for s in SLUICES),
        ]
    for path in images:
        rel = os.path.relpath(path, doc.parent)
        out += [f"![{path.stem}]({rel})", ""]
    out.append(END)
    return "\n".join(out)


def write_doc(generated: str, doc: Path = DOC) -> None:
    """Replace the generated block of docs/benchmarks.md (or append it)."""
    write_block(doc, generated, BEGIN, END)


def summary(runs: Sequence[TraceRun]) -> list[dict[str, object]]:
    """Every cell as a flat dict (the ``--json`` output)."""
    rows: list[dict[str, object]] = []
    for tr in runs:
        for c in [*tr.tuning, *tr.cells, *tr.spikes]:
            s = c.score
            rows.append(
                {
                    "trace": tr.trace,
                    "policy": c.spec.policy,
                    "knob": c.spec.knob,
                    "kind": "spike" if c.spec.spike else ("tuning" if c in tr.tuning else "load"),
                    "load": _load_of(c),
                    "offered_per_s": s.offered_rate,
                    "goodput_per_s": s.goodput,
                    "good_tokens_per_s": s.token_goodput,
                    "attainment": s.attainment,
                    "rejection_rate": s.rejection_rate,
                    "wasted": s.wasted,
                    "prompt_quartile_edges": None if s.by_prompt is None else list(s.by_prompt.edges),
                    "not_served_rate_by_prompt_quartile": (
                        None
                        if s.by_prompt is None
                        else [None if math.isnan(x) else x for x in s.by_prompt.rates]
                    ),
                    "by_tenant": {
                        name: {
                            "goodput_per_s": ts.goodput,
                            "good_tokens_per_s": ts.token_goodput,
                            "attainment": ts.attainment,
                            "rejection_rate": ts.rejection_rate,
                        }
                        for name, ts in c.by_tenant.items()
                    },
                    "recovery_s": c.recovery_s,
                    "rejections_stop_s": c.rejections_stop_s,
                    "seconds": c.seconds,
                    **asdict(s),
                    **c.extra,
                    "series": [list(x) for x in c.series],
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny configuration (seconds; for CI)")
    parser.add_argument(
        "--jobs", type=int, default=2, help="worker processes (default 2; 1 = in this process)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only; write neither docs/ nor plots")
    parser.add_argument("--json", type=Path, help="also write every cell's numbers to this file")
    parser.add_argument(
        "--doc", type=Path, default=DOC, help="markdown file to update (default docs/benchmarks.md)"
    )
    parser.add_argument("--img-dir", type=Path, default=IMG, help="where the plots go (default docs/img)")
    parser.add_argument(
        "--traces",
        nargs="+",
        choices=TRACES,
        help="replay only these traces (default: the plan's; the full plan replays both)",
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    if args.traces:
        plan = replace(plan, traces=tuple(args.traces))
    started = time.perf_counter()
    runs = run(plan, args.jobs)
    for tr in runs:
        checks = "".join(targets_check(tr, s) for s in SLUICES)
        print(f"## {tr.trace}\n\n{tuning_table(tr)}\n{results_table(tr)}\n{spike_table(tr)}\n{checks}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary(runs), indent=1), encoding="utf-8")
    elapsed = time.perf_counter() - started
    if not args.no_write:
        given = list(sys.argv[1:] if argv is None else argv)
        command = " ".join([".venv/bin/python -m bench.goodput", *given])
        images = plots(runs, plan, "-quick" if args.quick else "", args.img_dir)
        write_doc(report(runs, plan, command, images, elapsed, args.doc), args.doc)
        _log(f"wrote {args.doc}")
    _log(f"total {elapsed:.0f} s")
    return 0
