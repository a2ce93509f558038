"""``sluice plan`` (``python -m planner``): parse the options, build the workload and classes, make
the plan, print the report, write the JSON.

Exit codes as ``sluice``'s: 0 a plan was made (whether or not a count met the targets: the report
says), 2 a usage, trace or configuration error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.admission import AdmissionSettings
from planner.curve import DEFAULT_LOADS
from planner.plan import Plan, PlanOptions, class_targets, make_plan, with_targets
from planner.report import render_text, to_json
from planner.workload import Workload, load_workload, parse_length_dist, read_trace, synthetic_workload
from simulator.profile import Profile, list_profiles, load_profile

__all__ = ["build_parser", "main"]

EXIT_OK = 0
EXIT_USAGE = 2
DEFAULT_PROFILE = "llama3-8b-h100"
DEFAULT_SYNTHETIC_S = 60.0


def build_parser() -> argparse.ArgumentParser:
    """The options of ``sluice plan``."""
    p = argparse.ArgumentParser(
        prog="sluice plan",
        description="Capacity planning from the step model and emulator Sluice admits with: replicas "
        "needed for the classes' targets (replayed in virtual time through the admission engine), the KV "
        "check, recompute versus swap, cost, and a speculative-decoding what-if. Runs from a checkout.",
    )
    w = p.add_argument_group("workload: a trace, or a rate with length distributions")
    w.add_argument("--trace", type=Path, metavar="FILE", help="Azure LLM trace or Mooncake CSV")
    w.add_argument("--start-s", type=float, default=0.0, help="with --trace: slice from here (s)")
    w.add_argument(
        "--duration-s",
        type=float,
        help="with --trace: slice length (s, default to the end); synthetic: length "
        f"(default {DEFAULT_SYNTHETIC_S:g})",
    )
    w.add_argument(
        "--rate", type=float, metavar="R", help="requests/s (a trace is re-timed to it, burst shape kept)"
    )
    w.add_argument("--prompt-tokens", metavar="DIST", help="N, uniform:LO:HI or lognormal:MEDIAN:SIGMA")
    w.add_argument("--output-tokens", metavar="DIST", help="as --prompt-tokens")
    r = p.add_argument_group("replica and classes")
    r.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"a built-in profile ({', '.join(list_profiles())}) or a profile .yaml "
        f"(default {DEFAULT_PROFILE}); with --from-gateway, what the gateway does not tell",
    )
    r.add_argument(
        "--from-gateway",
        metavar="URL",
        help="plan with the step model a running gateway fitted, read from its admin API "
        "(GET URL/sluice/v1/replicas; the admin listener's URL when it has one)",
    )
    r.add_argument(
        "--admin-token-env",
        metavar="NAME",
        help="with --from-gateway: the environment variable holding the admin token",
    )
    r.add_argument("--replica", metavar="NAME", help="with --from-gateway: whose fit (default: the only one)")
    r.add_argument(
        "--kv-capacity-tokens",
        type=int,
        metavar="N",
        help="with --from-gateway: KV cache tokens per replica (default: the replica's last scrape)",
    )
    r.add_argument(
        "--block-size", type=int, metavar="N", help="with --from-gateway: KV block size (default: scraped)"
    )
    r.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="with --from-gateway: prompt + output cap (default: the replica's facts)",
    )
    r.add_argument(
        "--config", type=Path, metavar="FILE", help="a Sluice YAML: its admission section (classes)"
    )
    r.add_argument(
        "--class",
        dest="mix",
        action="append",
        metavar="NAME[=SHARE]",
        help="a class of the traffic and its share (repeat; default: the default class, all traffic)",
    )
    r.add_argument("--ttft-s", type=float, help="TTFT target of every class in the mix (s)")
    r.add_argument("--tpot-s", type=float, help="TPOT target of every class in the mix (s)")
    r.add_argument(
        "--attainment", type=float, help="share (0-1) of each class's requests that must meet both"
    )
    r.add_argument(
        "--policy",
        choices=("slo", "admit_all", "concurrency_cap", "saturation", "none"),
        help="admission policy to replay with (default: the configuration's, slo)",
    )
    s = p.add_argument_group("search and checks")
    s.add_argument("--max-replicas", type=int, default=64)
    s.add_argument("--warmup-s", type=float, default=0.0, help="arrivals before this are not scored (s)")
    s.add_argument("--max-tokens", type=int, default=1000, help="the clients' output cap (tokens)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--price-per-gpu-hour", type=float, metavar="USD", help="for the cost check")
    s.add_argument("--tokens-per-day", type=float, help="volume for GPU-hours (default: the replayed rate)")
    s.add_argument("--pcie-gbps", type=float, metavar="GB/S", help="host link per GPU, GB/s (swap check)")
    s.add_argument(
        "--spec-acceptance", type=float, metavar="ALPHA", help="speculative what-if: acceptance 0-1"
    )
    s.add_argument("--spec-draft-tokens", type=int, default=4, metavar="K", help="draft length (default 4)")
    s.add_argument("--draft-step-ms", type=float, help="the draft model's step time (ms)")
    s.add_argument(
        "--curve-loads",
        default=",".join(f"{x:g}" for x in DEFAULT_LOADS),
        metavar="X,Y,...",
        help="loads (fractions of one replica's saturated throughput) of the latency curve; "
        "'' for none (default %(default)s)",
    )
    s.add_argument(
        "--sweep",
        action="store_true",
        help="sweep max_num_seqs x max_num_batched_tokens for the best goodput per replica",
    )
    s.add_argument(
        "--sweep-seqs",
        metavar="N,M,...",
        help="max_num_seqs values (default 64,128,256,512 and the profile's)",
    )
    s.add_argument(
        "--sweep-budgets",
        metavar="N,M,...",
        help="max_num_batched_tokens values (default 2048,4096,8192 and the profile's)",
    )
    s.add_argument(
        "--sweep-seconds", type=float, default=20.0, help="arrivals replayed per setting (s, default 20)"
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, metavar="FILE", help="write the plan as JSON")
    o.add_argument("--plot-dir", type=Path, metavar="DIR", help="write plots here (PNG)")
    return p


def _mix(entries: Sequence[str] | None, default_class: str) -> dict[str, float]:
    if not entries:
        return {default_class: 1.0}
    mix: dict[str, float] = {}
    for entry in entries:
        name, _, share = entry.partition("=")
        mix[name] = float(share) if share else 1.0
    return mix


def _settings(config: Path | None) -> AdmissionSettings:
    if config is None:
        return AdmissionSettings()
    from gateway.config.load import load_settings

    return load_settings(config).admission


def _workload(args: argparse.Namespace, profile: Profile) -> Workload:
    limit = profile.engine.max_model_len
    if args.trace is not None:
        if args.prompt_tokens or args.output_tokens:
            raise ValueError("--prompt-tokens/--output-tokens are for a synthetic workload, not --trace")
        requests = read_trace(args.trace)
        return load_workload(
            requests,
            str(args.trace),
            limit,
            start_s=args.start_s,
            duration_s=args.duration_s,
            rate_per_s=args.rate,
        )
    if args.rate is None or not args.prompt_tokens or not args.output_tokens:
        raise ValueError("give --trace FILE, or --rate R with --prompt-tokens DIST and --output-tokens DIST")
    prompt, output = parse_length_dist(args.prompt_tokens), parse_length_dist(args.output_tokens)
    duration = args.duration_s or DEFAULT_SYNTHETIC_S
    requests = synthetic_workload(args.rate, prompt, output, duration, seed=args.seed)
    source = (
        f"Poisson {args.rate:g} req/s, prompt {prompt.describe()}, output {output.describe()} tokens, "
        f"seed {args.seed}"
    )
    if not requests:
        raise ValueError(f"{source}: no arrival in {duration:g} s")
    return load_workload(requests, source, limit, duration_s=duration)


def _profile(args: argparse.Namespace) -> tuple[Profile, tuple[str, ...]]:
    """The replica profile, and lines saying where its step times come from (empty for a
    built-in or file profile)."""
    template = load_profile(args.profile)
    gateway_only = {
        "--admin-token-env": args.admin_token_env,
        "--replica": args.replica,
        "--kv-capacity-tokens": args.kv_capacity_tokens,
        "--block-size": args.block_size,
        "--max-model-len": args.max_model_len,
    }
    if args.from_gateway is None:
        given = [flag for flag, value in gateway_only.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only with --from-gateway URL")
        return template, ()
    for flag in ("--kv-capacity-tokens", "--block-size", "--max-model-len"):
        value = gateway_only[flag]
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{flag} must be >= 1")
    from planner.gateway_profile import fetch_replicas, profile_from_gateway

    token = None
    if args.admin_token_env is not None:
        token = os.environ.get(args.admin_token_env)
        if not token:
            raise ValueError(
                f"--admin-token-env {args.admin_token_env}: that environment variable is not set"
            )
    body = fetch_replicas(args.from_gateway, token)
    built = profile_from_gateway(
        body,
        args.from_gateway,
        template,
        replica=args.replica,
        kv_capacity_tokens=args.kv_capacity_tokens,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
    )
    notes = (built.source, *(f"assumed: {line}" for line in built.assumed))
    return built.profile, notes


def _progress(line: str) -> None:
    print(f"sluice plan: {line}", file=sys.stderr, flush=True)


def _ints(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    """Comma-separated integers >= 1, or ``default`` (deduplicated, sorted) when ``text`` is None."""
    values = default if text is None else tuple(int(x) for x in text.split(",") if x.strip())
    if not values or min(values) < 1:
        raise ValueError(text)
    return tuple(sorted(set(values)))


def _plot(plan: Plan, folder: Path) -> None:
    """Write the plan's plots to ``folder`` and say where (or why not)."""
    from planner.plots import plot_curve

    if not plan.curve:
        print("plots: none (no latency curve was asked for)")
        return
    first = plan.classes[0]
    written = plot_curve(plan.curve, first.ttft_s, first.tpot_s, folder / "latency-vs-utilisation.png")
    if written is None:
        print("plots: skipped, matplotlib is not installed (pip install -e '.[bench]')")
    else:
        print(f"wrote {written}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``sluice plan``; returns the exit code."""
    args = build_parser().parse_args(argv)
    from gateway.config.load import ConfigError

    try:
        profile, profile_notes = _profile(args)
        settings = _settings(args.config)
        if args.policy is not None:
            settings = settings.model_copy(update={"policy": args.policy})
        mix = _mix(args.mix, settings.default_class)
        settings = with_targets(
            settings, list(mix), ttft_s=args.ttft_s, tpot_s=args.tpot_s, attainment=args.attainment
        )
        classes = class_targets(settings, mix)
        workload = _workload(args, profile)
    except (ValueError, ConfigError) as exc:
        print(f"sluice plan: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        loads = tuple(float(x) for x in args.curve_loads.split(",") if x.strip())
    except ValueError:
        print(
            f"sluice plan: --curve-loads {args.curve_loads!r}: expected numbers separated by commas",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if any(x <= 0 for x in loads):
        print("sluice plan: --curve-loads must be > 0", file=sys.stderr)
        return EXIT_USAGE
    seqs: tuple[int, ...] = ()
    budgets: tuple[int, ...] = ()
    if args.sweep or args.sweep_seqs or args.sweep_budgets:
        try:
            seqs = _ints(args.sweep_seqs, (64, 128, 256, 512, profile.engine.max_num_seqs))
            budgets = _ints(args.sweep_budgets, (2048, 4096, 8192, profile.engine.max_num_batched_tokens))
        except ValueError:
            print(
                "sluice plan: --sweep-seqs/--sweep-budgets: expected integers >= 1 separated by commas",
                file=sys.stderr,
            )
            return EXIT_USAGE
    options = PlanOptions(
        max_replicas=args.max_replicas,
        warmup_s=args.warmup_s,
        max_tokens=args.max_tokens,
        seed=args.seed,
        price_per_gpu_hour=args.price_per_gpu_hour,
        tokens_per_day=args.tokens_per_day,
        pcie_Bps=None if args.pcie_gbps is None else args.pcie_gbps * 1e9,
        acceptance=args.spec_acceptance,
        draft_tokens=args.spec_draft_tokens,
        draft_step_s=None if args.draft_step_ms is None else args.draft_step_ms / 1e3,
        curve_loads=loads,
        sweep_seqs=seqs,
        sweep_budgets=budgets,
        sweep_seconds=args.sweep_seconds,
    )
    plan = make_plan(
        workload, profile, settings, classes, options, progress=_progress, profile_notes=profile_notes
    )
    sys.stdout.write(render_text(plan))
    if args.plot_dir is not None:
        _plot(plan, args.plot_dir)
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(plan), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return EXIT_OK
