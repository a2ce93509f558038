"""A plan as a terminal report (``render_text``) and as JSON for tools (``to_json``).

The JSON mirrors the records field by field (``dataclasses.asdict``) plus the derived values the
text shows (attainment, meets, speedup); ``NaN`` and infinities become ``null``.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from planner.plan import Plan
from planner.replicas import ReplayScore
from planner.sweep import KNEE_SHARE, Sweep, SweepPoint

__all__ = ["render_text", "to_json"]


def _ms(s: float) -> str:
    return "-" if math.isnan(s) else f"{s * 1e3:.0f} ms"


def _num(x: float, fmt: str = ".1f") -> str:
    return "unbounded" if math.isinf(x) else format(x, fmt)


def _replay_lines(label: str, score: ReplayScore | None, plan: Plan) -> list[str]:
    if score is None:
        return [f"  {label}: not replayed (zero replicas serve nothing)"]
    verdict = "meets the targets" if score.meets else "MISSES the targets"
    fleet = score.replicas * plan.capacity_rps
    load = plan.workload.rate_per_s / fleet if fleet > 0 else math.nan
    lines = [
        f"  {label}: {score.replicas} replica(s) {verdict}; load {load:.0%} of saturated throughput; "
        f"goodput {score.goodput_rps:.2f} req/s, {score.goodput_output_tps:.0f} output tok/s; "
        f"{score.preemptions} preemption(s)"
    ]
    for c in score.classes:
        lines.append(
            f"    {c.name}: attainment {c.attainment:.1%} (target {c.target:.0%}) of {c.offered} "
            f"offered, {c.refused} refused; TTFT p50/p99 {_ms(c.ttft_p50_s)}/{_ms(c.ttft_p99_s)}, "
            f"TPOT p50/p99 {_ms(c.tpot_p50_s)}/{_ms(c.tpot_p99_s)}"
        )
    return lines


def render_text(plan: Plan) -> str:
    """The human-readable report."""
    w = plan.workload
    out = [
        f"sluice plan: profile {plan.profile}, admission policy {plan.policy}",
        *(f"  {line}" for line in plan.profile_notes),
        f"workload: {w.source}: {len(w.requests)} requests over {w.duration_s:.1f} s "
        f"({w.rate_per_s:.2f} req/s), mean prompt {w.mean_prompt_tokens:.0f} / output "
        f"{w.mean_output_tokens:.0f} tokens"
        + (f"; {w.too_long} left out (longer than max_model_len)" if w.too_long else ""),
        "classes: "
        + "; ".join(
            f"{c.name} ({c.share:.0%} of requests): TTFT <= {c.ttft_s:g} s, TPOT <= {c.tpot_s * 1e3:g} ms, "
            f"attainment >= {c.attainment:.0%}"
            for c in plan.classes
        ),
        "",
        "Replicas",
        f"  one replica's saturated throughput for this mix: {plan.capacity_rps:.2f} req/s "
        "(the search's first guess, no targets)",
    ]
    s = plan.search
    if s.replicas is None:
        out.append(f"  no count up to {s.limit} meets the targets (raise --max-replicas, or loosen them)")
        best = s.replays[max(s.replays)] if s.replays else None
        out += _replay_lines("largest tried", best, plan)
    else:
        out.append(f"  RECOMMENDED: {s.replicas} replica(s) ({s.replicas * plan.gpus_per_replica} GPU(s))")
        out += _replay_lines("at N", s.at, plan)
        out += _replay_lines("at N-1", s.below, plan)
    out.append(f"  replays run: {', '.join(str(n) for n in sorted(s.replays))}")
    out += ["", "KV cache (Little's law, per replica)"]
    for kv in (plan.kv_at_target, plan.kv_replayed):
        if kv is None:
            continue
        out.append(
            f"  at TPOT {kv.tpot_s * 1e3:.1f} ms ({kv.tpot_source}), {kv.rate_per_s:.2f} req/s per replica: "
            f"{kv.decode_concurrency:.1f} sequences decoding, {kv.tokens_in_flight:,.0f} KV tokens in flight "
            f"= {kv.kv_share:.1%} of {kv.capacity_tokens:,} ; preemption starts near "
            f"{_num(kv.preemption_rate_per_s, '.2f')} req/s per replica, max_num_seqs={kv.max_num_seqs} "
            f"binds near {_num(kv.seq_limit_rate_per_s, '.2f')} req/s"
        )
    out += ["", "Recompute versus swap (a preempted request's KV)"]
    sw = plan.swap
    if sw.break_even is None or sw.pcie_Bps is None:
        out.append(f"  not computed: missing {', '.join(sw.missing)}")
    else:
        b = sw.break_even
        other = "swap" if b.cheaper_short == "recompute" else "recompute"
        where = (
            f"{b.cheaper_short} is faster below {b.crossover_tokens} context tokens, {other} from there"
            if b.crossover_tokens is not None
            else f"{b.cheaper_short} is faster at every context length up to {b.max_tokens}"
        )
        out.append(
            f"  {sw.kv_bytes_per_token:,} KV bytes/token per GPU over {sw.pcie_Bps / 1e9:g} GB/s: "
            f"{where} (at {b.max_tokens} tokens: "
            f"recompute {_ms(b.recompute_at_max_s)}, swap out+in {_ms(b.swap_at_max_s)}). "
            "vLLM V1 always recomputes."
        )
    if plan.cost is not None:
        c = plan.cost
        out += [
            "",
            f"Cost at ${c.price_per_gpu_hour:g}/GPU-hour",
            f"  {c.replicas} replica(s) x {c.gpus_per_replica} GPU(s) = ${c.per_hour:.2f}/hour; "
            f"${c.per_million_tokens:.3f} per million tokens that met their targets (prompt + output), "
            f"${c.per_million_output_tokens:.3f} per million output tokens",
            f"  {c.tokens_per_day:,.0f} tokens a day take {c.gpu_hours_per_day:.1f} GPU-hours",
        ]
        for k in c.classes:
            out.append(
                f"  class {k.name}: {k.gpu_hours:.3g} GPU-hours of engine time in the replay "
                f"({k.gpu_hours_per_day:.1f} a day at this rate); ${k.per_million_tokens:.3f} per million "
                f"of its tokens (prompt + output, {k.tokens:,} finished), "
                f"${k.per_million_output_tokens:.3f} per million output tokens"
            )
        if c.classes:
            out.append(
                "  (a class's engine time is its requests' share of each step; idle time is in no class)"
            )
    if plan.speculative is not None:
        sp = plan.speculative
        out += ["", f"Speculative decoding what-if (k={sp.draft_tokens}, acceptance {sp.acceptance:g})"]
        if sp.missing:
            out.append(f"  not computed: missing {', '.join(sp.missing)}")
        else:
            out.append(
                f"  batch {sp.batch} at {sp.context_tokens} context tokens: {sp.tokens_per_step:.2f} tokens "
                f"per step; TPOT {_ms(sp.tpot_s)} plain -> {_ms(sp.tpot_spec_s)} speculative "
                f"(x{sp.speedup:.2f}; verify step {_ms(sp.verify_step_s)})"
            )
    if plan.curve:
        first = plan.classes[0]
        out += [
            "",
            "Latency against utilisation (one replica, no admission; load = offered / saturated throughput)",
            f"  {'load':>5} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
            f"{'met ' + first.name:>16}",
        ]
        for p in plan.curve:
            out.append(
                f"  {p.load:>5.0%} {p.rate_per_s:>6.2f} {_ms(p.ttft_p50_s):>9} {_ms(p.ttft_p99_s):>9} "
                f"{_ms(p.tpot_p50_s):>9} {_ms(p.tpot_p99_s):>9} {p.attainment:>16.1%}"
            )
    if plan.sweep is not None:
        out += ["", *_sweep_lines(plan.sweep, plan.policy)]
    return "\n".join(out) + "\n"


def _sweep_lines(sw: Sweep, policy: str) -> list[str]:
    seqs = sorted({p.max_num_seqs for p in sw.points})
    budgets = sorted({p.max_num_batched_tokens for p in sw.points})
    at = {(p.max_num_seqs, p.max_num_batched_tokens): p for p in sw.points}
    b = sw.best
    out = [
        f"Engine settings (one replica offered {sw.load:.0%} of its saturated throughput = "
        f"{sw.rate_per_s:.2f} req/s for {sw.seconds:.0f} s, policy {policy}; goodput in met req/s)",
        "  max_num_seqs \\ max_num_batched_tokens: " + " ".join(f"{x:>7}" for x in budgets),
    ]
    for s in seqs:
        cells = " ".join(f"{at[(s, x)].goodput_rps:>7.2f}" if (s, x) in at else f"{'-':>7}" for x in budgets)
        out.append(f"  {s:>40}: {cells}")
    out.append(
        f"  BEST: max_num_seqs={b.max_num_seqs}, max_num_batched_tokens={b.max_num_batched_tokens}: "
        f"{b.goodput_rps:.2f} met req/s per replica ({b.attainment:.1%} of offered met the targets)"
    )
    for k in sw.knees:
        other = "max_num_batched_tokens" if k.axis == "max_num_seqs" else "max_num_seqs"
        first, last = k.points[0], k.points[-1]
        out.append(
            f"  knee of {k.axis} (at {other}={k.fixed}): goodput within {KNEE_SHARE:.0%} of its best from "
            f"{k.knee}; from {_value(first, k.axis)} to {_value(last, k.axis)} TTFT p99 goes "
            f"{_ms(first.ttft_p99_s)} -> {_ms(last.ttft_p99_s)}, TPOT p99 {_ms(first.tpot_p99_s)} -> "
            f"{_ms(last.tpot_p99_s)}, goodput {first.goodput_rps:.2f} -> {last.goodput_rps:.2f} req/s"
        )
    return out


def _value(p: SweepPoint, axis: str) -> int:
    return p.max_num_seqs if axis == "max_num_seqs" else p.max_num_batched_tokens


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _score(score: ReplayScore | None) -> dict[str, Any] | None:
    if score is None:
        return None
    data = asdict(score)
    data["meets"] = score.meets
    for c, obj in zip(data["classes"], score.classes, strict=True):
        c["attainment"] = obj.attainment
        c["meets"] = obj.meets
    return data


def to_json(plan: Plan) -> dict[str, Any]:
    """The plan as plain JSON values."""
    w = plan.workload
    s = plan.search
    data: dict[str, Any] = {
        "profile": plan.profile,
        "profile_notes": list(plan.profile_notes),
        "policy": plan.policy,
        "gpus_per_replica": plan.gpus_per_replica,
        "workload": {
            "source": w.source,
            "requests": len(w.requests),
            "duration_s": w.duration_s,
            "rate_per_s": w.rate_per_s,
            "mean_prompt_tokens": w.mean_prompt_tokens,
            "mean_output_tokens": w.mean_output_tokens,
            "too_long": w.too_long,
        },
        "classes": [asdict(c) for c in plan.classes],
        "capacity_rps": plan.capacity_rps,
        "replicas": s.replicas,
        "max_replicas": s.limit,
        "at_n": _score(s.at),
        "at_n_minus_1": _score(s.below),
        "replays": {str(n): _score(r) for n, r in sorted(s.replays.items())},
        "kv_at_target": None if plan.kv_at_target is None else asdict(plan.kv_at_target),
        "kv_replayed": None if plan.kv_replayed is None else asdict(plan.kv_replayed),
        "swap": asdict(plan.swap),
        "cost": None if plan.cost is None else asdict(plan.cost),
        "speculative": None if plan.speculative is None else asdict(plan.speculative),
        "curve": [asdict(p) for p in plan.curve],
        "sweep": None if plan.sweep is None else asdict(plan.sweep),
    }
    if plan.speculative is not None:
        data["speculative"]["speedup"] = plan.speculative.speedup
    return _clean(data)  # type: ignore[no-any-return]
