"""The onset of an overload, in virtual time: a quiet spell, then several times what one replica
takes, with the clients' outputs pinned (``ignore_eos`` with ``max_tokens``, as ``vllm bench
serve`` and ``bench.closed_loop`` send them) or left to the model to end.

One replica of ``--profile`` with ``--max-num-seqs`` slots (4, as ``bench.closed_loop``'s vLLM
on CPU) behind the shipped ``AdmissionEngine`` (``replay.policies.SluicePolicy``). The trace
(``--traces``: the Azure conversation trace and Mooncake's, ``--seeds`` slices of them) runs
``--warm-s`` at half the replica's capacity for its mix (``replay.measure_capacity``), a quiet
spell of ``--quiet-s`` (one request in a hundred), then ``--duration`` at ``--load`` x capacity.
Requests that arrive in the overload are scored against one class (TTFT 1 s, TPOT 50 ms: the
goodput bench's targets on the H100 profile): admitted, their attainment (the share of the
admitted that met both targets), good requests per second, and the misses per 5 s of the
overload (admitted / missed), which shows where they come from.

With pinned outputs the gateway knows when each running request ends, and a full replica's
wait for a slot is never shorter than that schedule (``ReplicaState.slot_steps``); predicted
outputs leave it the finish rate it measured, which at the onset is the past's.

Run: ``.venv/bin/python -m bench.onset`` (both traces, four slices, both output modes: about a
minute of CPU per run; ``--jobs`` runs them in parallel). Prints one row per run and the sums
per trace and mode; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Final

from bench.goodput.core import FACTS, PROFILE, TARGETS
from gateway.admission import AdmissionSettings
from replay import (
    FleetConfig,
    fit_to_model_len,
    load_azure_trace,
    load_mooncake_trace,
    measure_capacity,
    piecewise_rate,
    run_gateway_replay,
)
from replay.policies import SluicePolicy
from simulator.profile import load_profile

#: Rows of the trace each slice takes, and how far apart the slices start.
_SLICE_ROWS: Final = 4000
_SLICE_STRIDE: Final = 3000
#: The quiet spell's rate, as a share of capacity.
_QUIET_LOAD: Final = 0.01
#: The width of the misses' bins (seconds).
_BIN_S: Final = 5.0
MODES: Final = ("pinned", "predicted")
SETTINGS: Final = AdmissionSettings.model_validate(
    {
        "classes": {"plain": {"ttft_target_s": TARGETS.ttft_s, "tpot_target_s": TARGETS.tpot_s}},
        "default_class": "plain",
    }
)


@dataclass(frozen=True, slots=True)
class Onset:
    """One run: what arrived in the overload, what was admitted and met, misses per bin."""

    trace: str
    seed: int
    mode: str
    capacity_per_s: float
    arrived: int
    admitted: int
    met: int
    duration_s: float
    #: (admitted, missed) per ``_BIN_S`` of the overload.
    bins: tuple[tuple[int, int], ...]

    @property
    def attainment(self) -> float:
        return self.met / self.admitted if self.admitted else float("nan")


def run_one(
    trace_name: str,
    seed: int,
    mode: str,
    *,
    load: float,
    warm_s: float,
    quiet_s: float,
    duration_s: float,
    max_num_seqs: int,
) -> Onset:
    """One replay of the onset (see the module)."""
    profile = load_profile(PROFILE).with_engine(max_num_seqs=max_num_seqs)
    facts = replace(FACTS, max_num_seqs=max_num_seqs)
    loader = load_azure_trace if trace_name == "azure" else load_mooncake_trace
    raw = loader(start=seed * _SLICE_STRIDE, count=_SLICE_ROWS)
    trace, _ = fit_to_model_len(raw, profile.engine.max_model_len)
    capacity = measure_capacity(profile, trace[:1000], min_requests=1000)
    timed = piecewise_rate(
        trace, [(warm_s, 0.5 * capacity), (quiet_s, _QUIET_LOAD * capacity), (duration_s, load * capacity)]
    )
    start = warm_s + quiet_s
    config = FleetConfig(
        profile, facts, replicas=1, tenants=1, jitter=0.02, seed=1 + seed, pinned_outputs=mode == "pinned"
    )
    result = run_gateway_replay(
        timed,
        config,
        SluicePolicy(SETTINGS, request_class="plain"),
        targets=TARGETS,
        scored=(0.0, start + duration_s),
    )
    bins = [[0, 0] for _ in range(max(1, round(duration_s / _BIN_S)))]
    arrived = admitted = met = 0
    for o in result.outcomes:
        if not start <= o.arrival_s < start + duration_s:
            continue
        arrived += 1
        if o.rejected:
            continue
        ttft = o.ttft_s
        ok = ttft is not None and ttft <= TARGETS.ttft_s and (o.tpot_s is None or o.tpot_s <= TARGETS.tpot_s)
        admitted += 1
        met += ok
        cell = bins[min(int((o.arrival_s - start) // _BIN_S), len(bins) - 1)]
        cell[0] += 1
        cell[1] += 0 if ok else 1
    return Onset(
        trace_name,
        seed,
        mode,
        capacity,
        arrived,
        admitted,
        met,
        duration_s,
        tuple((a, m) for a, m in bins),
    )


def report(runs: Sequence[Onset]) -> str:
    """The runs' table and the sums per trace and output mode, as markdown."""
    lines = [
        "| trace | seed | outputs | capacity req/s | arrived | admitted | attainment | good req/s "
        "| admitted / missed per 5 s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        bins = " ".join(f"{a}/{m}" for a, m in r.bins)
        lines.append(
            f"| {r.trace} | {r.seed} | {r.mode} | {r.capacity_per_s:.2f} | {r.arrived} | {r.admitted} "
            f"| {100 * r.attainment:.1f} % | {r.met / r.duration_s:.2f} | {bins} |"
        )
    lines += [
        "",
        "| trace | outputs | runs | admitted | met | attainment | good req/s (sum) |",
        "|---|---|---|---|---|---|---|",
    ]
    for trace in dict.fromkeys(r.trace for r in runs):
        for mode in dict.fromkeys(r.mode for r in runs):
            mine = [r for r in runs if r.trace == trace and r.mode == mode]
            admitted, met = sum(r.admitted for r in mine), sum(r.met for r in mine)
            share = f"{100 * met / admitted:.1f} %" if admitted else "-"
            good = sum(r.met / r.duration_s for r in mine)
            lines.append(f"| {trace} | {mode} | {len(mine)} | {admitted} | {met} | {share} | {good:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.onset", description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", nargs="+", choices=("azure", "mooncake"), default=["azure", "mooncake"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--outputs", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--load", type=float, default=4.0, help="the overload, x capacity")
    parser.add_argument("--warm-s", type=float, default=20.0)
    parser.add_argument("--quiet-s", type=float, default=30.0)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of overload scored")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    cells = [(t, s, m) for t in args.traces for s in args.seeds for m in args.outputs]
    knobs = {
        "load": args.load,
        "warm_s": args.warm_s,
        "quiet_s": args.quiet_s,
        "duration_s": args.duration,
        "max_num_seqs": args.max_num_seqs,
    }
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_one, t, s, m, **knobs) for t, s, m in cells]
        runs = [f.result() for f in futures]
    print(report(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
