"""One plan: the replica search and the closed-form checks for a workload, a profile and classes.

``make_plan`` runs, in order: one replica's saturated capacity for the workload's length mix
(``replay.measure_capacity``: the search's first guess), the replica search
(``planner.replicas.smallest_meeting``), then the checks (``planner.checks``) at the recommended
count. The answer is a frozen ``Plan``; ``planner.report`` renders it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.admission import AdmissionSettings
from planner import checks
from planner.closed_forms import mean_held_token_steps
from planner.curve import DEFAULT_LOADS, CurvePoint, utilisation_curve
from planner.replicas import ClassTarget, ReplayScore, SearchResult, replay_at, smallest_meeting
from planner.sweep import Sweep, engine_sweep
from planner.workload import Workload
from replay.emulated import measure_capacity
from simulator.profile import Profile

__all__ = ["Plan", "PlanOptions", "class_targets", "make_plan", "with_targets"]


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """What the plan is asked beyond the workload and classes.

    ``max_replicas``: the search's limit. ``warmup_s``: arrivals before it load the fleet but are
    not scored. ``max_tokens``: the clients' output cap. ``price_per_gpu_hour`` (``None``: no cost
    check), ``tokens_per_day`` (volume for GPU-hours; ``None``: the replayed rate),
    ``pcie_Bps`` (``None``: the swap check names it missing), ``acceptance`` / ``draft_tokens`` /
    ``draft_step_s`` (the speculative what-if; ``None`` acceptance: skipped). ``curve_loads``:
    the loads of the latency-against-utilisation curve (empty: no curve). ``sweep_seqs`` /
    ``sweep_budgets``: the engine-settings grid (either empty: no sweep), replayed for at most
    ``sweep_seconds`` of arrivals at ``sweep_load`` x the saturated throughput.
    """

    max_replicas: int = 64
    warmup_s: float = 0.0
    max_tokens: int = 1000
    seed: int = 0
    price_per_gpu_hour: float | None = None
    tokens_per_day: float | None = None
    pcie_Bps: float | None = None
    acceptance: float | None = None
    draft_tokens: int = 4
    draft_step_s: float | None = None
    curve_loads: tuple[float, ...] = DEFAULT_LOADS
    sweep_seqs: tuple[int, ...] = ()
    sweep_budgets: tuple[int, ...] = ()
    sweep_seconds: float = 20.0
    sweep_load: float = 1.5


@dataclass(frozen=True, slots=True)
class Plan:
    """A plan's answers (see the module docstring); ``None`` fields were not asked for, or could
    not be computed because no replica count met the targets."""

    profile: str
    gpus_per_replica: int
    policy: str
    workload: Workload
    classes: tuple[ClassTarget, ...]
    capacity_rps: float
    search: SearchResult
    kv_at_target: checks.KvCheck | None
    kv_replayed: checks.KvCheck | None
    swap: checks.SwapCheck
    cost: checks.CostCheck | None
    speculative: checks.SpeculativeCheck | None
    curve: tuple[CurvePoint, ...] = ()
    sweep: Sweep | None = None
    #: Where the profile's step times come from and what was assumed (a gateway's fit); empty
    #: for a built-in or file profile.
    profile_notes: tuple[str, ...] = ()


def with_targets(
    settings: AdmissionSettings,
    names: Sequence[str],
    *,
    ttft_s: float | None = None,
    tpot_s: float | None = None,
    attainment: float | None = None,
) -> AdmissionSettings:
    """``settings`` with the targets of the classes ``names`` replaced where given (a TTFT target
    also becomes the class's ``max_queue_wait_s``: a request waiting longer cannot meet it)."""
    data = settings.model_dump()
    for name in names:
        if name not in data["classes"]:
            known = ", ".join(sorted(data["classes"]))
            raise ValueError(f"unknown class {name!r} (configured: {known})")
        cls = data["classes"][name]
        if ttft_s is not None:
            cls["ttft_target_s"] = ttft_s
            cls["max_queue_wait_s"] = ttft_s
        if tpot_s is not None:
            cls["tpot_target_s"] = tpot_s
        if attainment is not None:
            cls["attainment_target"] = attainment
    return AdmissionSettings.model_validate(data)


def class_targets(settings: AdmissionSettings, mix: Mapping[str, float]) -> tuple[ClassTarget, ...]:
    """Each class of ``mix`` (name -> share of the traffic) with its targets from ``settings``."""
    out = []
    for name, share in mix.items():
        if name not in settings.classes:
            raise ValueError(f"unknown class {name!r} (configured: {', '.join(sorted(settings.classes))})")
        if share <= 0:
            raise ValueError(f"class {name!r}: share must be > 0")
        c = settings.classes[name]
        out.append(ClassTarget(name, c.ttft_target_s, c.tpot_target_s, c.attainment_target, share))
    return tuple(out)


def _replayed_tpot(score: ReplayScore) -> float | None:
    """Median TPOT of the class with the most finished requests (``None``: none finished)."""
    medians = [(c.offered - c.refused, c.tpot_p50_s) for c in score.classes if not math.isnan(c.tpot_p50_s)]
    return max(medians)[1] if medians else None


def make_plan(
    workload: Workload,
    profile: Profile,
    settings: AdmissionSettings,
    classes: Sequence[ClassTarget],
    options: PlanOptions,
    progress: Callable[[str], None] | None = None,
    profile_notes: Sequence[str] = (),
) -> Plan:
    """Search the replicas ``workload`` needs on ``profile`` under ``settings`` and run the checks.
    ``progress``: told one line per replay (for a long plan's terminal), or ``None``.
    ``profile_notes``: lines the report prints under the profile (where its step times come from)."""
    say = progress or (lambda _: None)
    say(f"measuring one replica's saturated throughput ({len(workload.requests)} requests)")
    capacity = measure_capacity(
        profile, workload.requests, max_tokens=options.max_tokens, seed=options.seed, min_requests=2000
    )
    start = max(1, math.ceil(workload.rate_per_s / capacity)) if capacity > 0 else 1

    def evaluate(n: int) -> ReplayScore:
        score = replay_at(
            workload,
            profile,
            settings,
            classes,
            n,
            seed=options.seed,
            warmup_s=options.warmup_s,
            max_tokens=options.max_tokens,
        )
        met = ", ".join(f"{c.name} {c.attainment:.1%}" for c in score.classes)
        say(f"{n} replica(s): {'meets' if score.meets else 'misses'} ({met})")
        return score

    search = smallest_meeting(evaluate, start, options.max_replicas)
    at = search.at
    n = search.replicas or options.max_replicas
    worst_tpot = max(c.tpot_s for c in classes)
    kv_target = checks.kv_check(profile, workload, n, worst_tpot, "the loosest TPOT target")
    replayed = None if at is None else _replayed_tpot(at)
    kv_replayed = (
        None if replayed is None else checks.kv_check(profile, workload, n, replayed, "replayed median")
    )
    cost = None
    if options.price_per_gpu_hour is not None and at is not None:
        cost = checks.cost_check(
            profile,
            n,
            at.goodput_tps,
            at.goodput_output_tps,
            options.price_per_gpu_hour,
            options.tokens_per_day,
            at.classes,
            at.run_s,
        )
    speculative = None
    if options.acceptance is not None:
        basis = kv_replayed or kv_target
        out = workload.mean_output_tokens
        context = round(mean_held_token_steps(workload.pairs()) / out) if out > 0 else 1
        speculative = checks.speculative_check(
            profile,
            max(1, round(basis.decode_concurrency)),
            context,
            options.acceptance,
            options.draft_tokens,
            options.draft_step_s,
        )
    curve: tuple[CurvePoint, ...] = ()
    if options.curve_loads and capacity > 0:
        say(f"latency curve: {len(options.curve_loads)} load(s) on one replica")
        curve = utilisation_curve(
            workload,
            profile,
            capacity,
            classes[0],
            loads=options.curve_loads,
            seed=options.seed,
            max_tokens=options.max_tokens,
        )
    sweep = None
    if options.sweep_seqs and options.sweep_budgets and capacity > 0:
        grid = len(options.sweep_seqs) * len(options.sweep_budgets)
        say(f"engine settings: {grid} setting(s) on one replica")
        sweep = engine_sweep(
            workload,
            profile,
            settings,
            classes,
            capacity,
            options.sweep_seqs,
            options.sweep_budgets,
            load=options.sweep_load,
            max_seconds=options.sweep_seconds,
            seed=options.seed,
            max_tokens=options.max_tokens,
        )
    return Plan(
        profile.name,
        profile.tensor_parallel,
        settings.policy,
        workload,
        tuple(classes),
        capacity,
        search,
        kv_target,
        kv_replayed,
        checks.swap_check(profile, options.pcie_Bps),
        cost,
        speculative,
        curve,
        sweep,
        tuple(profile_notes),
    )
