"""What one admission decision's arithmetic costs: forecasts over an 8-replica fleet.

Builds eight replica states (idle to saturated, some from per-request detail, some from scraped
aggregates only), then times with ``time.perf_counter_ns``:

* one forecast (``forecast_request``), per replica state;
* one sweep: the same request forecast on all eight replicas (what routing does per request);
* the helpers an admission runs next to it (output-length and prompt-token estimates);
* the prediction service (``gateway.prediction.PredictionService``): building one replica's
  state from the gateway's in-flight list (``replica_inputs``, once per view rebuild in the live
  gateway, O(in flight)), and ``forecast`` (state build plus forecast, per call);
* one calibration fit (once per scrape per replica, not per request).

The cost target: one forecast for one replica <= 20 us with 8 replicas' worth of state in one
process; the summary line compares the slowest replica's median with it.

Each figure is the median over ``--samples`` samples of ``--batch`` back-to-back calls, per call.
Run: ``.venv/bin/python -m bench.forecast_cost`` (no assertion on speed anywhere: machines differ).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from gateway.prediction import PredictionService, ReplicaFacts
from gateway.replicas.snapshot import InFlight
from predictor import (
    CandidateRequest,
    OutputLengthPredictor,
    PromptTokenEstimator,
    ReplicaState,
    RunningSeq,
    StepBatch,
    StepCalibrator,
    StepModel,
    forecast_request,
    lookup_gpu,
    lookup_model,
    roofline_prior,
)


def per_call_us(fn: Callable[[], object], batch: int, samples: int) -> float:
    """Median over ``samples`` of the mean time per call of ``batch`` back-to-back calls (us)."""
    fn()  # warm caches and lazy paths outside the timed region
    times = []
    for _ in range(samples):
        start = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter_ns() - start) / batch / 1000.0)
    return statistics.median(times)


KV_CAPACITY, MAX_SEQS, BUDGET, MAX_LEN = 400_000, 1024, 8192, 131_072
TARGET_US = 20.0
SERVICE_MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def aggregate(
    running: int, waiting: int, kv: int, queued: int = 0, mean_remaining: float = 0.0
) -> ReplicaState:
    """A state as scraped aggregates give it: every running request decoding."""
    return ReplicaState(
        running,
        waiting,
        running,
        kv,
        KV_CAPACITY,
        MAX_SEQS,
        BUDGET,
        MAX_LEN,
        queued_prefill_tokens=queued,
        queued_requests=waiting,
        mean_remaining_output_tokens=mean_remaining,
    )


def detailed(rng: random.Random, running: int, waiting: int) -> ReplicaState:
    """A state built from per-request detail (what the gateway knows of its own requests)."""
    # Contexts sized so the batch uses about 60% of the KV cache, as a healthy replica would.
    mean_context = min(2000, int(0.6 * KV_CAPACITY / running))
    seqs = []
    for _ in range(running):
        prompt = rng.randint(mean_context // 4, mean_context * 3 // 2)
        seqs.append(
            RunningSeq(
                prompt_tokens=prompt,
                computed_tokens=prompt if rng.random() < 0.95 else rng.randint(0, prompt),
                generated_tokens=rng.randint(0, mean_context // 4),
                expected_output_tokens=rng.randint(400, 800),
            )
        )
    return ReplicaState.from_sequences(
        seqs,
        [rng.randint(50, mean_context) for _ in range(waiting)],
        kv_capacity_tokens=KV_CAPACITY,
        max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=BUDGET,
        max_model_len=MAX_LEN,
    )


def fleet(rng: random.Random) -> list[tuple[str, ReplicaState]]:
    """Eight replicas, from idle to saturated; three built from per-request detail."""
    return [
        ("idle", aggregate(0, 0, 0)),
        ("light", aggregate(8, 0, 8 * 900, mean_remaining=150.0)),
        ("busy-aggregates", aggregate(120, 6, 120 * 1800, queued=9000)),
        ("kv-full-aggregates", aggregate(300, 40, 398_000, queued=60_000)),
        ("detail-64", detailed(rng, 64, 0)),
        ("detail-256", detailed(rng, 256, 8)),
        ("detail-1000", detailed(rng, 1000, 30)),
        ("long-prompt-ahead", aggregate(32, 1, 32 * 2000, queued=100_000)),
    ]


def service_with_traffic(rng: random.Random) -> PredictionService:
    """A prediction service with one H100 replica that has seen 2,000 finished requests."""
    svc = PredictionService(output_quantile=0.9)
    facts = ReplicaFacts(
        gpu="H100-SXM", model=SERVICE_MODEL, max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET
    )
    svc.set_replica("r0", facts)
    for _ in range(2000):
        svc.on_finished(
            replica="r0",
            model=SERVICE_MODEL,
            tenant=None,
            prompt_chars=4 * rng.randint(100, 3000),
            prompt_tokens=rng.randint(100, 3000),
            completion_tokens=int(rng.lognormvariate(5.5, 1.0)),
        )
    return svc


def in_flight(rng: random.Random, n: int, now: float) -> list[InFlight]:
    """``n`` of the gateway's requests on a replica: 9 in 10 streaming, the rest awaiting prefill."""
    return [
        InFlight(
            f"r{i}",
            rng.randint(100, 3000),
            rng.randint(1, 300) if i % 10 else 0,
            now - rng.uniform(0.1, 20.0),
            512,
            now - 0.003 if i % 10 else None,
        )
        for i in range(n)
    ]


def calibrated(prior: StepModel, rng: random.Random) -> StepCalibrator:
    """A calibrator holding a full ring of plausible step observations."""
    cal = StepCalibrator(prior)
    for i in range(512):
        n = rng.randint(1, 256)
        chunk = rng.randint(0, 8192 - n) if rng.random() < 0.4 else 0
        batch = StepBatch(chunk, n, n * rng.randint(200, 4000), chunk * chunk / 2)
        cal.observe_step(i * 5.0, batch, prior.step_time(batch) * rng.uniform(0.9, 1.2))
    return cal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2000, help="calls per timed sample")
    parser.add_argument("--samples", type=int, default=25, help="timed samples (median reported)")
    args = parser.parse_args()
    rng = random.Random(7)
    model = roofline_prior(lookup_model("Llama-3-8B"), lookup_gpu("H100-SXM"))
    states = fleet(rng)
    request = CandidateRequest(
        prompt_tokens=1800, max_tokens=1024, expected_output_tokens=400, output_quantile=0.9
    )

    def one(state: ReplicaState) -> Callable[[], object]:
        return lambda: forecast_request(request, state, model)

    rows: list[tuple[str, float, str]] = []
    for name, state in states:
        f = forecast_request(request, state, model)
        note = f"ttft {f.ttft_s * 1e3:8.1f} ms  tpot {f.tpot_s * 1e3:6.1f} ms  valid={f.valid}"
        rows.append(
            (
                f"forecast: {name}",
                per_call_us(one(state), args.batch, args.samples),
                note,
            )
        )
    slowest = max(us for _, us, _ in rows)

    def sweep() -> None:
        for _, s in states:
            forecast_request(request, s, model)

    rows.append(
        (
            "sweep: 8 replicas",
            per_call_us(sweep, max(1, args.batch // 8), args.samples),
            "one request, every replica",
        )
    )

    lengths = OutputLengthPredictor()
    for _ in range(4000):
        lengths.observe("llama", rng.choice(("acme", "globex", None)), int(rng.lognormvariate(5.5, 1.0)))
    rows.append(
        (
            "output length p90 (tenant)",
            per_call_us(lambda: lengths.predict("llama", "acme", 1024, 0.9), args.batch, args.samples),
            "",
        )
    )
    chars = PromptTokenEstimator()
    rows.append(
        (
            "prompt tokens from chars",
            per_call_us(lambda: chars.estimate("llama", 7200), args.batch, args.samples),
            "",
        )
    )
    svc = service_with_traffic(rng)
    for n in (64, 500):
        flight = in_flight(rng, n, 100.0)

        def build(flight: list[InFlight] = flight) -> object:
            return svc.replica_inputs("r0", model=SERVICE_MODEL, tenant=None, in_flight=flight, now=100.0)

        def service_forecast(flight: list[InFlight] = flight) -> object:
            return svc.forecast(
                "r0",
                model=SERVICE_MODEL,
                tenant=None,
                prompt_tokens=1800,
                max_tokens=1024,
                in_flight=flight,
                now=100.0,
            )

        rows.append(
            (
                f"service: state build, {n} in flight",
                per_call_us(build, max(1, args.batch // 20), args.samples),
                "replica_inputs: per view rebuild, not per request",
            )
        )
        rows.append(
            (
                f"service.forecast, {n} in flight",
                per_call_us(service_forecast, max(1, args.batch // 20), args.samples),
                "state build + one forecast, per call",
            )
        )
    cal = calibrated(model, rng)
    rows.append(
        (
            "calibration fit (512 obs)",
            per_call_us(lambda: cal.fit(2600.0), 5, max(5, args.samples // 5)),
            "per scrape, not per request",
        )
    )

    width = max(len(r[0]) for r in rows)
    print(f"{'operation':<{width}}  {'median us/call':>14}  notes")
    print(f"{'-' * width}  {'-' * 14}  -----")
    for label, us, note in rows:
        print(f"{label:<{width}}  {us:14.2f}  {note}")
    verdict = "within" if slowest <= TARGET_US else "over"
    print(
        f"\none forecast on one replica (8 replicas' states in this process): {slowest:.1f} us median on "
        f"the slowest state, {verdict} the {TARGET_US:.0f} us target"
    )


if __name__ == "__main__":
    main()
