"""Why Sluice's goodput and waste are what they are: the same cells with one setting changed.

Replays the Azure trace at 1x and 2x load (the goodput bench's cells: same trace slice, same
fleet) with Sluice's default configuration and with single changes to it, next to the tuned
saturation-shedding baseline, and prints a table of goodput, token goodput, attainment,
rejections and wasted GPU time. Settings only: the admission and prediction code is the one that
ships. ``--seeds`` repeats every cell with other engine seeds (the 2 % step-time jitter), which
shows how much one run's numbers move.

Run: ``.venv/bin/python -m bench.goodput.ablation`` (``--loads``, ``--seeds``, ``--variants``,
``--jobs``; ``--trace mooncake`` for the other trace, ``--spike`` to add the spike scenario with
its recovery time, ``--no-baseline`` to leave out the reference rows).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Final

from bench.goodput.core import PROFILE, TRACES, Plan, run_cell, spike, steady, trace_requests
from gateway.replay import measure_capacity
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
)
#: The tuned saturation-shedding baseline's KV threshold (the bench's choice on Azure at 1x).
BASELINE_KV: Final = 0.4


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
    args = parser.parse_args(argv)
    plan = Plan()
    trace, _ = trace_requests(args.trace)
    capacity = measure_capacity(load_profile(PROFILE), trace[: plan.capacity_rows], seed=plan.seed)
    mean = sum(r.prompt_tokens + r.output_tokens for r in trace) / len(trace)
    labels = {VARIANTS[i][1]: VARIANTS[i][0] for i in args.variants}
    specs = [
        replace(steady(args.trace, "sluice", None, load, plan, capacity, mean), sluice_overrides=o, seed=seed)
        for o in labels
        for seed in args.seeds
        for load in args.loads
    ]
    if args.spike:
        specs += [
            replace(spike(args.trace, "sluice", None, plan, capacity, mean), sluice_overrides=o, seed=seed)
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
        "| recovery after the spike |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
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
            print(
                f"| {label} | {spec.seed} | {load} | {s.goodput:.1f} | "
                f"{s.token_goodput / 1e3:.1f} | {100 * s.attainment:.1f} % | "
                f"{100 * s.rejection_rate:.1f} % | {100 * s.wasted:.1f} % | {recovery} |",
                flush=True,
            )
            if args.diagnose:
                details = ", ".join(f"{k} {v:g}" for k, v in res.extra.items())
                print(f"  {label}, {spec.phases[0][1]:g}x: {details}", file=sys.stderr, flush=True)
    print(f"(capacity {capacity:.2f} req/s per replica, {plan.replicas} replicas)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
