"""PredictionService: facts -> prior, snapshots -> fit, in-flight -> forecast, usage -> learning."""

from __future__ import annotations

import dataclasses
import json
import math
from functools import cache

import pytest

from gateway.prediction import PredictionConfig, PredictionService, ReplicaFacts
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from predictor import Forecast, ForecastReason, ModelSource, StepBatch
from replay import ReplayConfig, at_rate, fit_to_model_len, load_azure_trace, run_replay
from simulator.costmodel import CostModel, StepShape
from simulator.profile import Profile, load_profile

H100 = ReplicaFacts(
    gpu="H100-SXM",
    model="meta-llama/Meta-Llama-3-8B-Instruct",
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    max_model_len=8192,
)
UNKNOWN = dataclasses.replace(H100, gpu=None)
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


@cache
def profile() -> Profile:
    return load_profile("llama3-8b-h100")


def service_with(facts: ReplicaFacts = H100) -> PredictionService:
    svc = PredictionService()
    svc.set_replica("r0", facts)
    return svc


def trained(facts: ReplicaFacts) -> PredictionService:
    """A service that watched 150 trace requests (~4 req/s) on the H100 emulator, in virtual time."""
    svc = PredictionService()
    trace, _ = fit_to_model_len(load_azure_trace(count=150), 8192)
    run_replay(at_rate(trace, 4.0), ReplayConfig(profile=profile(), facts=facts, seed=3), svc)
    return svc


def forecast(
    svc: PredictionService, in_flight: list[InFlight], now: float = 10.0, prompt: int = 1000
) -> Forecast:
    return svc.forecast(
        "r0", model=MODEL, tenant=None, prompt_tokens=prompt, max_tokens=500, in_flight=in_flight, now=now
    )


def test_unknown_replica_gives_an_invalid_forecast() -> None:
    f = PredictionService().forecast(
        "nowhere", model=MODEL, tenant=None, prompt_tokens=100, max_tokens=10, in_flight=[], now=0.0
    )
    assert (f.valid, f.reason) == (False, ForecastReason.NO_STEP_MODEL)
    assert math.isnan(f.ttft_s)


def test_known_hardware_forecasts_from_the_prior_before_any_scrape() -> None:
    svc = service_with(H100)
    f = forecast(svc, [])
    prior = H100.prior()
    assert f.valid
    assert f.reason is None
    # Alone on an idle replica: one step carrying its 1000-token prompt.
    alone = StepBatch(prefill_tokens=1000, prefill_attn_pairs=1000 * 1000 / 2)
    assert f.ttft_s == pytest.approx(prior.step_time(alone), rel=1e-9)
    report = svc.report("r0")
    assert report is not None
    assert report.source == ModelSource.PRIOR


def decoding(n: int, boundary: float) -> list[InFlight]:
    return [InFlight(f"d{i}", 800, 40, 0.0, 1000, boundary) for i in range(n)]


def pending(n: int, started: float) -> list[InFlight]:
    return [InFlight(f"p{i}", 2000, 0, started, 1000, None) for i in range(n)]


LOADS = [
    [],
    decoding(16, 9.995),
    decoding(64, 9.995),
    decoding(64, 9.995) + pending(3, 9.998),
    decoding(64, 9.995) + pending(12, 9.998),
]


def test_more_in_flight_means_later_first_token_and_slower_tokens() -> None:
    svc = service_with(H100)
    forecasts = [forecast(svc, load) for load in LOADS]
    ttfts = [f.ttft_s for f in forecasts]
    tpots = [f.tpot_s for f in forecasts]
    assert all(f.valid for f in forecasts)
    assert ttfts == sorted(ttfts)
    assert len(set(ttfts)) == len(ttfts)
    assert tpots[:3] == sorted(tpots[:3])
    assert tpots[0] < tpots[2]


@pytest.mark.parametrize(
    ("since_boundary", "waits"),
    [(0.001, True), (0.5, False)],
    ids=["step-just-started", "step-should-be-over"],
)
def test_the_step_in_progress_is_waited_for(since_boundary: float, waits: bool) -> None:
    svc = service_with(H100)
    f = forecast(svc, decoding(32, 10.0 - since_boundary))
    assert (f.step_wait_s > 0.0) == waits


def test_unknown_hardware_is_learned_from_observations_alone() -> None:
    before = service_with(UNKNOWN)
    f = forecast(before, [])
    assert (f.valid, f.reason) == (False, ForecastReason.NO_STEP_MODEL)
    svc = trained(UNKNOWN)
    report = svc.report("r0")
    model = svc.step_model("r0")
    assert report is not None
    assert model is not None
    assert (report.valid, report.source, report.prior) == (True, ModelSource.FITTED, None)
    assert forecast(svc, []).valid
    truth = CostModel(profile())
    # After 150 requests: the decode steps it saw within 5 %, the prefill steps its TTFTs
    # measured within 15 % (two slopes around one knee only approximate the measured GEMM curve).
    for n, ctx, prompt, rel in [
        (8, 1200, 0, 0.05),
        (24, 1500, 0, 0.05),
        (0, 0, 1000, 0.15),
        (16, 1300, 3000, 0.15),
    ]:
        shape = StepShape(prefill_chunks=((prompt, 0),) if prompt else (), decode_contexts=(ctx,) * n)
        batch = StepBatch(prompt, n, n * ctx, prompt * prompt / 2)
        assert model.step_time(batch) == pytest.approx(truth.step_time_s(shape), rel=rel), (n, prompt)


def test_the_fit_moves_the_prior_toward_the_replica() -> None:
    svc = trained(H100)
    report = svc.report("r0")
    assert report is not None
    assert report.mdape is not None
    assert report.prior_mdape is not None
    assert report.source == ModelSource.FITTED
    assert report.mdape < report.prior_mdape


def test_on_finished_learns_output_lengths_and_characters_per_token() -> None:
    svc = service_with(H100)
    assert forecast(svc, []).output_tokens_used != 12.0
    for _ in range(40):
        svc.on_finished(
            replica="r0",
            model=MODEL,
            tenant=None,
            prompt_chars=3000,
            prompt_tokens=1000,
            completion_tokens=12,
        )
    assert forecast(svc, []).output_tokens_used == 12.0
    assert svc.estimate_prompt_tokens(MODEL, 3000) == pytest.approx(1000, rel=0.05)
    assert svc.estimate_prompt_tokens("another-model", 4000) == 1000  # the 4 chars/token prior


def test_what_one_tenant_teaches_is_its_own() -> None:
    """A tenant's output lengths and characters per token size its own requests; another
    tenant's are sized by the model's fleet prior, where the first is one vote of several."""
    svc = service_with(H100)
    for _ in range(60):
        svc.on_finished(
            replica="r0", model=MODEL, tenant="a", prompt_chars=2, prompt_tokens=9, completion_tokens=4000
        )
        svc.on_finished(
            replica="r0",
            model=MODEL,
            tenant="b",
            prompt_chars=6000,
            prompt_tokens=1000,
            completion_tokens=100,
        )
    assert svc.expected_output(MODEL, "a", None)[0] == 4000
    assert svc.expected_output(MODEL, "b", None)[0] == 100
    assert svc.expected_output(MODEL, "newcomer", None)[0] == 256  # a 4000, b 100, the prior 256
    assert svc.estimate_prompt_tokens(MODEL, 6000, "b") == pytest.approx(1000, abs=1)
    assert svc.estimate_prompt_tokens(MODEL, 12_000, "newcomer") == pytest.approx(2400, abs=1)  # 4 and 6: 5
    assert svc.fewest_prompt_tokens(12_000) == 750


@pytest.mark.parametrize(
    ("ttft_s", "timed", "counted"),
    [(None, False, False), ("priced", False, True), ("tiny", False, False), ("priced", True, False)],
    ids=["no-ttft", "plausible-ttft", "implausible-ttft", "engine-times-its-prefills"],
)
def test_a_measured_ttft_becomes_a_prefill_step_observation(
    ttft_s: str | None, timed: bool, counted: bool
) -> None:
    """Unless the engine times its prefill steps itself (TGI): then those are the observations."""
    svc = service_with(H100)
    if timed:
        snapshot = ReplicaSnapshot(
            name="r0",
            taken_at=1.0,
            metrics_at=1.0,
            num_running=0,
            num_waiting=0,
            prefill_step_time_mean_s=0.02,
        )
        svc.on_snapshot(snapshot)
    f = forecast(svc, [])
    measured = {None: None, "priced": 0.9 * f.ttft_s, "tiny": 0.05 * f.ttft_s}[ttft_s]
    before = svc.refit("r0", 1.0)
    svc.on_finished(
        replica="r0",
        model=MODEL,
        tenant=None,
        prompt_chars=None,
        prompt_tokens=1000,
        completion_tokens=20,
        finished_at=1.0,
        forecast=f,
        ttft_s=measured,
    )
    after = svc.refit("r0", 1.0)
    assert before is not None
    assert after is not None
    assert after.observations_total - before.observations_total == (1 if counted else 0)


def test_stale_metrics_flag_the_forecast() -> None:
    svc = service_with(H100)
    snapshot = ReplicaSnapshot(name="r0", taken_at=1.0, metrics_at=1.0, num_running=0, num_waiting=0)
    svc.on_snapshot(snapshot)
    fresh, old = forecast(svc, [], now=2.0), forecast(svc, [], now=60.0)
    assert fresh.valid
    assert (old.valid, old.reason) == (False, ForecastReason.STALE_STATE)
    assert old.ttft_s == pytest.approx(fresh.ttft_s)  # computed, but flagged


def test_same_facts_keep_the_fit_and_new_facts_restart_it() -> None:
    svc = trained(H100)
    fitted = svc.report("r0")
    svc.set_replica("r0", H100)
    assert svc.report("r0") is fitted
    svc.set_replica("r0", dataclasses.replace(H100, max_num_seqs=256))
    report = svc.report("r0")
    assert report is not None
    assert (report.source, report.observations_total) == (ModelSource.PRIOR, 0)
    svc.remove_replica("r0")
    assert svc.report("r0") is None
    assert svc.replicas() == ()


def test_describe_is_json_ready() -> None:
    svc = trained(H100)
    svc.set_replica("cpu-box", UNKNOWN)
    described = json.loads(json.dumps(svc.describe()))
    r0 = described["replicas"]["r0"]
    assert r0["facts"]["gpu"] == "H100-SXM"
    assert r0["fit"]["source"] == "fitted"
    assert r0["fit"]["valid"] is True
    assert set(r0["fit"]["params"]) >= {"base", "tokens_past_knee", "kv_tokens", "knee_tokens"}
    assert r0["snapshots"] > 0
    assert r0["stale"] is False
    assert described["replicas"]["cpu-box"]["fit"]["prior"] is None
    assert described["output_quantile"] == 0.5


@pytest.mark.parametrize(
    "kwargs",
    [{"refit_interval_s": -1.0}, {"stale_after_s": 0.0}, {"prefill_share_weight": 1.5}],
    ids=["negative-refit-interval", "zero-staleness", "share-weight-above-one"],
)
def test_config_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        PredictionConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "facts",
    [{"tensor_parallel": 0}, {"max_num_seqs": 0}, {"max_model_len": 0}],
    ids=["zero-tp", "zero-seqs", "zero-model-len"],
)
def test_facts_validation(facts: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        ReplicaFacts(**facts)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("gateway_ttft_s", "engine_ttft_s", "overhead_s"),
    [(0.024, 0.021, 0.003), (0.020, 0.021, 0.0), (0.021, 0.021, 0.0)],
    ids=["transport-adds-3ms", "never-negative", "no-transport"],
)
def test_dispatch_overhead_is_learned_from_the_replicas_own_ttft(
    gateway_ttft_s: float, engine_ttft_s: float, overhead_s: float
) -> None:
    """The gateway's TTFTs against the replica's TTFT metric, window by window (EWMA from 0)."""
    svc = PredictionService(config=PredictionConfig(learn_dispatch_overhead=True))
    svc.set_replica("r0", H100)
    engine = forecast(svc, [], now=0.5)
    for second in range(1, 41):
        for k in range(12):
            svc.on_finished(
                replica="r0",
                model=MODEL,
                tenant=None,
                prompt_chars=None,
                prompt_tokens=None,
                completion_tokens=None,
                finished_at=second - 1 + k / 12,
                ttft_s=gateway_ttft_s,
            )
        snapshot = ReplicaSnapshot(
            name="r0",
            taken_at=float(second),
            metrics_at=float(second),
            window_s=10.0,
            ttft_mean_s=engine_ttft_s,
        )
        svc.on_snapshot(snapshot)
    replica = svc.describe()["replicas"]
    assert isinstance(replica, dict)
    assert replica["r0"]["dispatch_overhead_s"] == pytest.approx(overhead_s, abs=1e-4)
    f = forecast(svc, [], now=40.5)
    assert f.overhead_s == pytest.approx(overhead_s, abs=1e-4)
    assert f.ttft_s == pytest.approx(engine.ttft_s + f.overhead_s, rel=0.02)


def test_dispatch_overhead_is_off_by_default() -> None:
    svc = service_with(H100)
    engine = forecast(svc, [], now=0.5)
    for second in range(1, 21):
        svc.on_finished(
            replica="r0",
            model=MODEL,
            tenant=None,
            prompt_chars=None,
            prompt_tokens=None,
            completion_tokens=None,
            finished_at=second - 0.5,
            ttft_s=0.05,
        )
        svc.on_snapshot(
            ReplicaSnapshot(
                name="r0", taken_at=float(second), metrics_at=float(second), window_s=10.0, ttft_mean_s=0.02
            )
        )
    f = forecast(svc, [], now=20.5)
    assert f.overhead_s == 0.0
    assert f.ttft_s == pytest.approx(engine.ttft_s, rel=0.02)
