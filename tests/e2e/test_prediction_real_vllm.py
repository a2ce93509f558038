"""The gateway's live forecasts against a real vLLM on CPU: every request forecast, forecasts sane.

The gateway runs in this test's event loop in front of the session's real vLLM (tiny random Llama,
``--max-num-seqs 4``). It knows only the engine limits the operator launched vLLM with (4
sequences, vLLM's CPU default of 2048 batched tokens): GPU and model are unknown, so every step
time comes from the fit to the replica's own ``/metrics``. ``CONCURRENCY`` clients stream chat
completions in a closed loop (more than ``max-num-seqs``, so requests queue in the engine),
prompts of 50-900 characters and 16-64 output tokens with ``ignore_eos``, for ``LOAD_S`` seconds
and until ``MIN_SAMPLES`` requests sent after ``WARMUP_S`` seconds were answered with a forecast (a
slow host makes the run longer, not a failure).

These are behaviour checks, not the accuracy targets: every request carries a forecast, the
replica's step-model fit is valid once warmed up (``GET /sluice/v1/replicas``), and the median of
predicted / observed TTFT (the gateway's dispatch -> first token) lies within 3x, and the
median forecast TPOT within 2x of the engine's own mean TPOT over the same seconds
(``vllm:request_time_per_output_token_seconds``). A broken scrape of vLLM's metrics, a fit that
never converges or a unit error fails them; the spread of a contended 2-core host should not:
the fit wanders in its first seconds (hence the warm-up), and the client's TPOT is no measure
there (vLLM's API server, starved of CPU, often sends a stream's tokens in a few bursts). A
failure prints what the gateway learned (the fit, the dispatch overhead, the corrections) and
the TTFT by load.

The accuracy targets (TTFT median <= 15 %, p90 <= 35 %; TPOT median <= 10 %, p90 <= 25 %) are
measured by ``python -m bench.predictor_accuracy_vllm`` at several loads (docs/predictor-accuracy.md,
"Live"): on this CPU setup the TTFT targets do not hold.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import pytest
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from bench.live_accuracy import (
    ErrorStats,
    Sample,
    Workload,
    accuracy,
    closed_loop,
    describe,
    enough_measured,
    measured,
    observed_summary,
    serve_gateway,
    ttft_by_load,
    wait_until_ready,
)
from gateway.admission.config import AdmissionSettings, ClassSettings
from gateway.config.settings import LoggingSettings, ServerSettings, Settings
from gateway.replicas.config import HardwareSettings, HealthSettings, ReplicaSettings
from tests.e2e.vllm_cpu import MAX_NUM_SEQS, SERVED_MODEL
from tests.support import speed

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

REPLICA = "vllm-cpu"
#: vLLM's CPU default of --max-num-batched-tokens for the OpenAI server (vllm.engine.arg_utils).
CPU_DEFAULT_BATCHED_TOKENS = 2048
CONCURRENCY = 6
#: Seconds of load at least, and the first of them left out while the fit learns from the first
#: scrape windows (its forecasts wander most there).
LOAD_S = 40.0
WARMUP_S = 15.0
#: Measured requests the run goes on until (the median ratios need a few dozen; an idle 2-core
#: machine measures ~250 in the 25 s after the warm-up, one with two busy loops beside it ~130).
MIN_SAMPLES = 40
#: Requests after the warm-up at most, so a run whose forecasts never come still ends.
MAX_REQUESTS = 10 * MIN_SAMPLES
#: A ceiling on the load's seconds, should neither count ever be reached.
MAX_LOAD_S = 240.0
#: The median of predicted / observed TPOT must lie within this on an idle host: forecasts within
#: 2x of the engine's own. vLLM shares the host's cores with the gateway and the clients, and both
#: sides carry its stalls differently, so the bounds widen by the host-speed factor.
RATIO_BOUNDS = (0.5, 2.0)
#: The same for the gateway's TTFT: within 3x. A TTFT here is mostly the API server's share of
#: the cores and the wait for a slot, not engine steps (a p90 error of 140-190 % on an idle
#: 2-core host, and a median 2.5x high on another CI host), so 2x is the benchmark's business
#: (``bench.predictor_accuracy_vllm``); a unit error, a broken scrape or a fit gone wrong is off
#: by far more than 3x.
TTFT_RATIO_BOUNDS = (1.0 / 3.0, 3.0)
#: The engine's per-request TPOT histogram (seconds).
ENGINE_TPOT = "vllm:request_time_per_output_token_seconds"


@dataclass(frozen=True)
class Run:
    """Every request of the load (``samples``), those measured after the warm-up with an ``ok``
    forecast (``kept``), their errors by ``accuracy`` key, ``/sluice/v1/replicas`` at the end, and
    the engine's mean TPOT in seconds over the requests it finished from the end of the warm-up
    to the end of the load (NaN when it finished none), and the ``diagnosis`` a failure prints."""

    samples: list[Sample]
    kept: list[Sample]
    errors: dict[str, ErrorStats]
    replicas_view: dict[str, Any]
    engine_tpot_s: float
    #: The run's numbers and what the gateway learned, for every failure message.
    diagnosis: str


async def engine_tpot_totals(session: aiohttp.ClientSession, vllm_base_url: str) -> tuple[float, float]:
    """(sum of seconds, count) of vLLM's per-request TPOT histogram now."""
    async with session.get(vllm_base_url + "/metrics") as resp:
        text = await resp.text()
    totals = {"_sum": 0.0, "_count": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == ENGINE_TPOT:
            for sample in family.samples:
                for suffix in totals:
                    if sample.name == ENGINE_TPOT + suffix:
                        totals[suffix] += sample.value
    return totals["_sum"], totals["_count"]


def gateway_settings(vllm_base_url: str) -> Settings:
    hardware = HardwareSettings(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=CPU_DEFAULT_BATCHED_TOKENS)
    return Settings(
        server=ServerSettings(port=0),
        replicas=[ReplicaSettings(name=REPLICA, url=vllm_base_url, hardware=hardware)],
        health=HealthSettings(interval_s=1.0, timeout_s=1.0),
        logging=LoggingSettings(access_log=False),
        # No forecast margin: the headers then carry the predictor's own forecast (admission's
        # default 0.15 is a safety factor on its decisions and would add 15 % to every ratio).
        # Loose targets: every request is admitted however slow the host (the default class's
        # would refuse some once the measured correction shows how slow a busy host is).
        admission=AdmissionSettings(
            forecast_margin=0.0,
            classes={
                "interactive": ClassSettings(ttft_target_s=5.0, tpot_target_s=50.0, max_queue_wait_s=30.0)
            },
        ),
    )


@pytest.fixture(scope="module")
def run(vllm_base_url: str) -> Run:
    """One load run through the gateway for every test of this module."""
    enough = enough_measured([REPLICA], warmup_s=WARMUP_S, wanted=MIN_SAMPLES, max_requests=MAX_REQUESTS)
    started = time.monotonic()

    def stop(samples: Sequence[Sample]) -> bool:
        return time.monotonic() - started >= LOAD_S and enough(samples)

    async def load() -> tuple[list[Sample], dict[str, Any], float]:
        workload = Workload(SERVED_MODEL, prompt_chars=(50, 900), max_tokens=(16, 64))
        async with (
            serve_gateway(gateway_settings(vllm_base_url)) as gateway,
            aiohttp.ClientSession() as session,
        ):
            await wait_until_ready(gateway.url, SERVED_MODEL)

            async def after_warmup() -> tuple[float, float]:
                await asyncio.sleep(WARMUP_S)
                return await engine_tpot_totals(session, vllm_base_url)

            nonlocal started
            started = time.monotonic()
            warm = asyncio.create_task(after_warmup())
            got = await closed_loop(
                gateway.url,
                workload,
                concurrency=CONCURRENCY,
                duration_s=MAX_LOAD_S,
                think_s=0.1,
                stop=stop,
            )
            (sum_0, count_0), (sum_1, count_1) = await warm, await engine_tpot_totals(session, vllm_base_url)
            async with session.get(gateway.url + "/sluice/v1/replicas") as resp:
                assert resp.status == 200, await resp.text()
                view: dict[str, Any] = await resp.json()
        engine_tpot_s = (sum_1 - sum_0) / (count_1 - count_0) if count_1 > count_0 else float("nan")
        return gateway.with_gateway_ttft(got), view, engine_tpot_s

    speed.factor(fresh=True)  # before and after the load: the larger one counts
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # as `sluice serve` runs
        samples, view, engine_tpot_s = runner.run(load())
    kept = measured(samples, warmup_s=WARMUP_S)
    errors = accuracy(kept)
    span_s = max(s.sent_at for s in samples) - min(s.sent_at for s in samples)
    diagnosis = "\n".join(
        [
            f"host-speed factor {speed.factor(fresh=True):.2f}; {len(samples)} requests in {span_s:.0f} s, "
            f"{len(kept)} measured after {WARMUP_S:g} s of warm-up",
            describe(errors),
            observed_summary(kept),
            f"engine TPOT after the warm-up: {engine_tpot_s * 1000:.2f} ms (mean, {ENGINE_TPOT})",
            ttft_by_load(samples, kept),
            replica_learning(view),
        ]
    )
    print(diagnosis)
    return Run(samples, kept, errors, view, engine_tpot_s, diagnosis)


def replica_learning(view: dict[str, Any]) -> str:
    """What the gateway learned of the replica (``GET /sluice/v1/replicas``'s prediction part):
    the fit's error, the dispatch overhead and the measured TTFT and TPOT corrections."""
    replica = view["prediction"]["replicas"][REPLICA]
    fit, correction = replica["fit"], replica.get("correction") or {}
    lines = [
        f"fit {fit['source']} valid={fit['valid']} mdape={fit.get('mdape')} "
        f"observations={fit.get('observations_total')}; "
        f"dispatch overhead {replica.get('dispatch_overhead_s', float('nan')) * 1000:.1f} ms"
    ]
    for metric in ("ttft", "tpot"):
        learned = correction.get(metric) or {}
        regimes = ", ".join(
            f"{r['regime']} {r['factor']:.2f} (n={r['samples']})" for r in learned.get("regimes", [])
        )
        lines.append(
            f"{metric} correction {learned.get('factor', 1.0):.2f}, "
            f"{learned.get('out_of_range_total', 0)} of {learned.get('samples_total', 0)} out of range; "
            + regimes
        )
    return "\n".join(lines)


def test_every_request_was_served_and_forecast(run: Run) -> None:
    assert all(s.status == 200 for s in run.samples), sorted({s.status for s in run.samples})
    assert all(s.replica == REPLICA for s in run.samples)
    # Every answer says what became of its forecast (the header is there even when it is not ok).
    assert all(s.prediction is not None for s in run.samples)
    start = min(s.sent_at for s in run.samples) + WARMUP_S
    late = [s for s in run.samples if s.sent_at >= start]
    assert len(run.kept) >= 0.9 * len(late), sorted({s.prediction or "-" for s in late})
    assert all(s.predicted_ttft_s is not None and s.predicted_tpot_s is not None for s in run.kept)
    assert len(run.kept) >= MIN_SAMPLES


def test_the_replicas_fit_is_valid_after_the_warmup(run: Run) -> None:
    fit = run.replicas_view["prediction"]["replicas"][REPLICA]["fit"]
    # Hardware and model unknown: no roofline prior, so a valid model is one fitted to vLLM's metrics.
    assert (fit["valid"], fit["source"]) == (True, "fitted"), fit
    assert fit["observations_total"] > 0, fit
    assert fit["params"], fit


def test_ttft_forecasts_within_3x_of_measured(run: Run) -> None:
    errors = run.errors["ttft_gateway"]
    assert errors.n >= MIN_SAMPLES, describe({"ttft_gateway": errors})
    low, high = speed.widened(*TTFT_RATIO_BOUNDS)
    assert low <= errors.median_ratio <= high, run.diagnosis


def test_tpot_forecasts_within_2x_of_the_engines_own(run: Run) -> None:
    forecasts = [s.predicted_tpot_s for s in run.kept if s.predicted_tpot_s is not None]
    assert len(forecasts) >= MIN_SAMPLES
    ratio = float(np.median(forecasts)) / run.engine_tpot_s  # NaN (no finished request) fails below
    low, high = speed.widened(*RATIO_BOUNDS)
    assert low <= ratio <= high, (
        f"median forecast {np.median(forecasts) * 1000:.2f} ms, engine {run.engine_tpot_s * 1000:.2f} ms\n"
        + run.diagnosis
    )
