"""The gateway's live forecasts against what requests then measured, on the replica emulator.

The real gateway (``build_app`` on a free port, in this process) fronts one emulator process
(``python -m simulator --profile llama3-8b-h100``) and is told only what an operator would know:
an H100-SXM serving Llama-3-8B with vLLM's engine limits. Eight clients stream chat completions in
a closed loop (prompts of 200-3000 characters, 32-128 output tokens, ``ignore_eos``) for
``LOAD_S`` seconds: about 1000 SSE events a second. Requests sent in the first ``WARMUP_S``
seconds are left out (the fit needs a few scrapes).

The clients run in the gateway's own process and loop: their work delays the gateway's relaying
of first tokens, which the TTFT measured at the gateway then carries and no forecast of the
engine can know. With twelve clients (until 2026-12-02) that noise alone decided the TTFT p90 on
a slower host: on a 2-core VM 3-4x slower than usual, the same tree gave 32-41 % in 3 runs (the
tree before that day's changes 32-41 % too), and 25-28 % in 3 runs with eight clients.

Each request's ``x-sluice-predicted-*`` headers are compared with its own TTFT and TPOT (issue 3's
targets, ``bench.live_accuracy.TARGETS``). TTFT is judged as the gateway measured it, from its
dispatch to the replica to the first token back: that is what the engine forecast is about. The
client's TTFT adds the gateway's own work and a loopback hop (~1-2 ms); it is printed next to it.

Until 2026-12-01 this was marked ``accuracy`` and left out of the default run: its TTFT p90 was
38-40 % against 35 %. With the replica's dispatch overhead in the forecast and the step the
request catches (docs/predictor-accuracy.md, "Live"), 11 runs in a row on a quiet 2-core box gave
TTFT p90 22.2-24.3 % (at the gateway) and TPOT p90 6.0-11.7 %, so it runs by default.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import uvloop

from bench.live_accuracy import (
    TARGETS,
    ErrorStats,
    Sample,
    Workload,
    accuracy,
    closed_loop,
    describe,
    measured,
    observed_summary,
    serve_gateway,
    ttft_by_load,
    wait_until_ready,
)
from gateway.admission.config import AdmissionSettings
from gateway.settings import (
    HardwareSettings,
    HealthSettings,
    LoggingSettings,
    ReplicaSettings,
    ServerSettings,
    Settings,
)
from tests.support.procs import Proc, free_port, python_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROFILE = "llama3-8b-h100"
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"  # the profile's served_model_name
#: What an operator who launched vLLM for this replica knows (config/profiles/llama3-8b-h100.yaml).
HARDWARE = HardwareSettings(
    gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=1024, max_num_batched_tokens=8192
)
CONCURRENCY = 8
LOAD_S = 22.0
WARMUP_S = 6.0
#: Fewer measured requests than this would make the quantiles meaningless.
MIN_SAMPLES = 100


@dataclass(frozen=True)
class Run:
    samples: list[Sample]
    kept: list[Sample]
    errors: dict[str, ErrorStats]


async def _measure(emulator_url: str) -> list[Sample]:
    settings = Settings(
        server=ServerSettings(port=0),
        replicas=[ReplicaSettings(name="emu", url=emulator_url, hardware=HARDWARE)],
        health=HealthSettings(interval_s=1.0, timeout_s=1.0),
        logging=LoggingSettings(access_log=False),
        # No forecast margin: the headers then carry the predictor's own forecast (admission's
        # default 0.15 is a safety factor on its decisions, and would add 15 % to every error).
        admission=AdmissionSettings(forecast_margin=0.0),
    )
    async with serve_gateway(settings) as gateway:
        await wait_until_ready(gateway.url, MODEL)
        samples = await closed_loop(
            gateway.url, Workload(MODEL), concurrency=CONCURRENCY, duration_s=LOAD_S, think_s=0.05, seed=3
        )
        return gateway.with_gateway_ttft(samples)


@pytest.fixture(scope="module")
def run() -> Run:
    """One emulator, one gateway, one load run for every test of this module."""
    port = free_port()
    args = python_module(
        "simulator", "--profile", PROFILE, "--port", str(port), "--seed", "1", "--jitter", "0.02"
    )
    emulator = Proc(args, name="emulator")
    try:
        emulator.wait_http(f"http://127.0.0.1:{port}/health")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # as `sluice serve` runs
            samples = runner.run(_measure(f"http://127.0.0.1:{port}"))
    finally:
        emulator.stop()
    kept = measured(samples, warmup_s=WARMUP_S)
    errors = accuracy(kept)
    print(f"\n{len(samples)} requests, {len(kept)} measured after {WARMUP_S:g} s of warm-up")
    print(describe(errors))
    print(observed_summary(kept))
    print(ttft_by_load(samples, kept))
    return Run(samples, kept, errors)


def test_every_request_was_forecast(run: Run) -> None:
    assert all(s.status == 200 for s in run.samples)
    assert all(s.replica == "emu" for s in run.samples)
    after_warmup = measured(run.samples, warmup_s=WARMUP_S)  # keeps only forecasts that are "ok"
    late = [s for s in run.samples if s.sent_at >= min(x.sent_at for x in run.samples) + WARMUP_S]
    assert len(after_warmup) >= 0.95 * len(late), {s.prediction for s in late}
    assert len(run.kept) >= MIN_SAMPLES


@pytest.mark.parametrize(("metric", "target"), [("ttft_gateway", TARGETS["ttft"]), ("tpot", TARGETS["tpot"])])
def test_forecast_error_within_target(run: Run, metric: str, target: tuple[float, float]) -> None:
    errors = run.errors[metric]
    assert errors.n >= MIN_SAMPLES
    assert errors.met(*target), describe({metric: errors})
