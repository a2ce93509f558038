"""Why Sluice's goodput and waste are what they are: the same cells with one setting changed.

Replays the Azure trace at 1x and 2x load (the goodput bench's cells: same trace slice, same
fleet) with Sluice's default configuration and with single changes to it, next to the tuned
saturation-shedding baseline, and prints a table of goodput, token goodput, attainment,
rejections, wasted GPU time and the share served per prompt-size quartile of the trace (with
the longest quartile's over the shortest's: whether long prompts are starved). Settings only: the
admission and prediction code is the one that ships. ``--seeds`` repeats every cell with other
engine seeds (the 2 % step-time jitter), which shows how much one run's numbers move.

Run: ``.venv/bin/python -m bench.goodput.ablation`` (``--loads``, ``--seeds``, ``--variants``,
``--jobs``; ``--trace mooncake`` for the other trace, ``--spike`` to add the spike scenario with
its recovery time, ``--no-baseline`` to leave out the reference rows). ``--quick`` replays every
cell with the goodput bench's tiny plan (``bench.goodput.core.QUICK``: one replica, seconds of
virtual time, a shorter capacity measurement): the same table, in seconds, for CI.

``--forecast-accuracy`` also scores Sluice's forecasts on the same cells: per scored request that
was served and finished, the forecast its admission decision made at dispatch (the predictor's
own, admission's ``forecast_margin`` divided out) against the TTFT (dispatch -> first token) and
TPOT the engine measured (``bench.goodput.metrics.forecast_accuracy``), printed as a second table.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Final

from bench.goodput.core import (
    PROFILE,
    QUICK,
    TRACES,
    CellResult,
    Plan,
    admission_settings,
    run_cell,
    spike,
    steady,
    trace_requests,
)
from bench.goodput.metrics import Score
from bench.predictor_accuracy import TPOT_MEDIAN, TPOT_P90, TTFT_MEDIAN, TTFT_P90, ErrorStats, pct, verdict
from replay import measure_capacity
from simulator.profile import load_profile

#: (label, overrides): ``class.<key>`` changes the interactive class, other keys the section.
VARIANTS: Final[tuple[tuple[str, tuple[tuple[str, float | None], ...]], ...]] = (
    ("defaults (stall budget, horizon 0.02)", ()),
    ("stall budget off", (("class.stall_budget_horizon", None),)),
    ("budget off, forecast_margin 0.3", (("class.stall_budget_horizon", None), ("forecast_margin", 0.3))),
    ("budget off, forecast_margin 0.5", (("class.stall_budget_horizon", None), ("forecast_margin", 0.5))),
    ("budget off, max_stall_s 0.1", (("class.stall_budget_horizon", None), ("class.max_stall_s", 0.1))),
    ("budget off, max_stall_s 0.05", (("class.stall_budget_horizon", None), ("class.max_stall_s", 0.05))),
    ("stall budget, horizon 1", (("class.stall_budget_horizon", 1.0),)),
    ("stall budget, horizon 0.5", (("class.stall_budget_horizon", 0.5),)),
    ("stall budget, horizon 0.25", (("class.stall_budget_horizon", 0.25),)),
    ("stall budget, horizon 0.1", (("class.stall_budget_horizon", 0.1),)),
    ("stall budget, horizon 0.02", (("class.stall_budget_horizon", 0.02),)),
    ("size fairness off", (("class.size_fairness.enabled", False),)),
    ("size fairness, min_share 0.35", (("class.size_fairness.min_share", 0.35),)),
)
#: The tuned saturation-shedding baseline's KV threshold (the bench's choice on Azure at 1x).
BASELINE_KV: Final = 0.4


def served_by_quartile(s: Score) -> tuple[str, str]:
    """(served / offered per prompt-size quartile of the trace, shortest first, as
    ``"97 / 84 / 68 / 32 %"``; the longest quartile's share served over the shortest's, as
    ``"0.33"``): whether long prompts are starved. ``-`` where a quartile has no request."""
    if s.by_prompt is None:
        return "-", "-"
    served = [1.0 - r for r in s.by_prompt.rates]
    text = " / ".join("-" if math.isnan(x) else f"{100 * x:.0f}" for x in served) + " %"
    ratio = served[3] / served[0] if served[0] > 0 else math.nan
    return text, "-" if math.isnan(ratio) else f"{ratio:.2f}"


def _met(stats: ErrorStats, median_target: float, p90_target: float) -> str:
    """``bench.predictor_accuracy.verdict``, or ``n/a`` when nothing was scored."""
    return "n/a" if stats.n == 0 else verdict(stats, median_target, p90_target)


def accuracy_table(trace: str, rows: Sequence[tuple[str, CellResult]]) -> str:
    """Markdown: per (label, cell) with ``accuracy``, the predictor's own TTFT and TPOT errors at
    dispatch (median / p90 APE, median signed error as bias, met or not), then the same with
    admission's margin applied (what the decision, and the live headers, carry)."""
    out = [
        "| trace | policy | seed | load | served | TTFT n | TTFT med | TTFT p90 | TTFT bias | TTFT met "
        "| TPOT n | TPOT med | TPOT p90 | TPOT bias | TPOT met | stale | margin x | with margin: "
        "TTFT med / p90 | TPOT med / p90 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---:|---:|:---:|---:|---:|---:|---:|",
    ]
    for label, res in rows:
        a = res.accuracy
        if a is None:
            continue
        ttft, tpot = a.ttft, a.tpot
        scale = f"{1.0 + admission_settings(res.spec.sluice_overrides).forecast_margin:g}"
        load = "spike" if res.spec.spike is not None else f"{res.spec.phases[0][1]:g}x"
        out.append(
            f"| {trace} | {label} | {res.spec.seed} | {load} | {a.served} | {ttft.n} | "
            f"{pct(ttft.median_ape)} | {pct(ttft.p90_ape)} | {pct(ttft.bias)} | "
            f"{_met(ttft, TTFT_MEDIAN, TTFT_P90)} | "
            f"{tpot.n} | {pct(tpot.median_ape)} | {pct(tpot.p90_ape)} | {pct(tpot.bias)} | "
            f"{_met(tpot, TPOT_MEDIAN, TPOT_P90)} | {a.stale} | {scale} | "
            f"{pct(a.ttft_with_margin.median_ape)} / {pct(a.ttft_with_margin.p90_ape)} | "
            f"{pct(a.tpot_with_margin.median_ape)} / {pct(a.tpot_with_margin.p90_ape)} |"
        )
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--loads", nargs="+", type=float, default=[1.0, 2.0])
    parser.add_argument("--trace", choices=TRACES, default="azure")
    parser.add_argument("--spike", action="store_true", help="also replay the spike scenario")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="engine seeds (default 0)")
    parser.add_argument(
        "--variants", nargs="+", type=int, default=list(range(len(VARIANTS))), help="indices into VARIANTS"
    )
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--no-baseline", action="store_true", help="leave out the saturation-shedding reference rows"
    )
    parser.add_argument(
        "--diagnose", action="store_true", help="also print why requests missed or were refused"
    )
    parser.add_argument(
        "--forecast-accuracy",
        action="store_true",
        help="also score Sluice's dispatch forecasts (the predictor's own, margin divided out) against "
        "the TTFT and TPOT its served requests measured; printed as a second table",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the goodput bench's tiny plan (seconds; for CI)"
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    trace, _ = trace_requests(args.trace)
    capacity = measure_capacity(load_profile(PROFILE), trace[: plan.capacity_rows], seed=plan.seed)
    mean = sum(r.prompt_tokens + r.output_tokens for r in trace) / len(trace)
    labels = {VARIANTS[i][1]: VARIANTS[i][0] for i in args.variants}
    specs = [
        replace(
            steady(args.trace, "sluice", None, load, plan, capacity, mean),
            sluice_overrides=o,
            seed=seed,
            forecast_accuracy=args.forecast_accuracy,
        )
        for o in labels
        for seed in args.seeds
        for load in args.loads
    ]
    if args.spike:
        specs += [
            replace(
                spike(args.trace, "sluice", None, plan, capacity, mean),
                sluice_overrides=o,
                seed=seed,
                forecast_accuracy=args.forecast_accuracy,
            )
            for o in labels
            for seed in args.seeds
        ]
    if not args.no_baseline:
        specs += [
            replace(steady(args.trace, "saturation", BASELINE_KV, load, plan, capacity, mean), seed=seed)
            for seed in args.seeds
            for load in args.loads
        ]
    print(
        "| policy | seed | load | goodput req/s | good ktok/s | attainment | rejected | GPU time wasted "
        "| recovery after the spike | served by prompt quartile Q1 / Q2 / Q3 / Q4 | Q4 / Q1 |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    scored: list[tuple[str, CellResult]] = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for res in pool.map(run_cell, specs):
            s, spec = res.score, res.spec
            label = (
                f"Sluice, {labels[spec.sluice_overrides]}"
                if spec.policy == "sluice"
                else f"saturation shedding, KV > {spec.knob:g}"
            )
            load = "spike" if spec.spike is not None else f"{spec.phases[0][1]:g}x"
            recovery = "-"
            if spec.spike is not None:
                recovery = "not within the span" if res.recovery_s is None else f"{res.recovery_s:g} s"
            served, ratio = served_by_quartile(s)
            print(
                f"| {label} | {spec.seed} | {load} | {s.goodput:.1f} | "
                f"{s.token_goodput / 1e3:.1f} | {100 * s.attainment:.1f} % | "
                f"{100 * s.rejection_rate:.1f} % | {100 * s.wasted:.1f} % | {recovery} | "
                f"{served} | {ratio} |",
                flush=True,
            )
            if res.accuracy is not None:
                scored.append((label, res))
            if args.diagnose:
                details = ", ".join(f"{k} {v:g}" for k, v in res.extra.items())
                print(f"  {label}, {spec.phases[0][1]:g}x: {details}", file=sys.stderr, flush=True)
    if scored:
        print(
            "\nSluice's dispatch forecasts against what its served requests measured (APE; the "
            "predictor's own forecast, then with admission's margin as the decision carried it):\n"
        )
        print(accuracy_table(args.trace, scored), end="", flush=True)
    print(f"(capacity {capacity:.2f} req/s per replica, {plan.replicas} replicas)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
