"""PredictionService's expected-future-load term: the arrival rate and sizes it learns from the
requests it sees finish, the steady state they imply, and forecasts with and without it."""

from __future__ import annotations

import math

import pytest

from gateway.prediction import PredictionConfig, PredictionService, ReplicaFacts
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from predictor.steady import TrafficMix, steady_state

H100 = ReplicaFacts(
    gpu="H100-SXM",
    model="meta-llama/Meta-Llama-3-8B-Instruct",
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    max_model_len=8192,
)
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def fed(*, steady: bool, per_second: int, seconds: int = 30, output: int = 101) -> PredictionService:
    """A service that saw ``per_second`` requests (100-token prompts, ``output`` tokens) finish on
    r0 every second for ``seconds`` s, with a scrape at every whole second."""
    svc = PredictionService(config=PredictionConfig(steady_state=steady))
    svc.set_replica("r0", H100)
    svc.on_snapshot(ReplicaSnapshot(name="r0", taken_at=0.0, metrics_at=0.0, num_running=0, num_waiting=0))
    for second in range(1, seconds + 1):
        for k in range(per_second):
            svc.on_finished(
                replica="r0",
                model=MODEL,
                tenant=None,
                prompt_chars=None,
                prompt_tokens=100,
                completion_tokens=output,
                finished_at=second - 1 + k / per_second,
            )
        at = float(second)
        svc.on_snapshot(ReplicaSnapshot(name="r0", taken_at=at, metrics_at=at, num_running=0, num_waiting=0))
    return svc


def steady_of(svc: PredictionService) -> dict[str, float] | None:
    replicas = svc.describe()["replicas"]
    assert isinstance(replicas, dict)
    value = replicas["r0"]["steady_state"]
    assert value is None or isinstance(value, dict)
    return value


def decoding(n: int, at: float) -> list[InFlight]:
    return [InFlight(str(i), 800, 50, at - 2.0, 1000, at - 0.005) for i in range(n)]


def test_steady_rate_and_sizes_give_the_littles_law_batch() -> None:
    svc = fed(steady=True, per_second=10)
    got = steady_of(svc)
    assert got is not None
    # 300 finishes over the 30 s since the replica was first seen: lambda = 10/s, each request
    # decodes 101 - 1 = 100 steps, so N = lambda E[O - 1] T = 1000 T.
    assert got["decode_seqs"] == pytest.approx(10 * 100 * got["step_s"], rel=1e-6)
    model = svc.step_model("r0")
    assert model is not None
    # The same numbers as the predictor's function on the mix computed by hand (context over the
    # decode 100 + 101 / 2 tokens).
    expected = steady_state(
        TrafficMix(10.0, (100.0,), 100.0, 150.5),
        model,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        kv_capacity_tokens=float(1 << 40),
    )
    assert expected is not None
    assert got["step_s"] == pytest.approx(expected.step_s, rel=1e-9)
    assert got["prefill_share"] == pytest.approx(expected.prefill_share, rel=1e-9)


def test_more_arrivals_settle_at_longer_steps() -> None:
    light, heavy = steady_of(fed(steady=True, per_second=5)), steady_of(fed(steady=True, per_second=20))
    assert light is not None
    assert heavy is not None
    assert heavy["step_s"] > light["step_s"]
    assert heavy["decode_seqs"] > 4 * light["decode_seqs"]


def test_without_arrivals_or_when_off_the_forecast_is_todays() -> None:
    off = fed(steady=False, per_second=10)
    on_idle = fed(steady=True, per_second=10, seconds=30)
    # Nothing finished for the last 100 s: no arrival rate, no steady state.
    for second in range(31, 131):
        at = float(second)
        on_idle.on_snapshot(
            ReplicaSnapshot(name="r0", taken_at=at, metrics_at=at, num_running=0, num_waiting=0)
        )
        off.on_snapshot(ReplicaSnapshot(name="r0", taken_at=at, metrics_at=at, num_running=0, num_waiting=0))
    assert steady_of(on_idle) is None
    assert steady_of(off) is None
    now = 130.5
    kwargs = {"model": MODEL, "tenant": None, "prompt_tokens": 500, "max_tokens": 1000, "now": now}
    a = off.forecast("r0", in_flight=decoding(40, now), **kwargs)  # type: ignore[arg-type]
    b = on_idle.forecast("r0", in_flight=decoding(40, now), **kwargs)  # type: ignore[arg-type]
    assert a == b


def test_the_term_moves_tpot_toward_the_steady_state_and_spares_one_token_outputs() -> None:
    now = 30.5
    # 20 arrivals a second decoding 400 steps each: a steady batch of 8000 T, far above 5.
    off, on = fed(steady=False, per_second=20, output=401), fed(steady=True, per_second=20, output=401)
    target = steady_of(on)
    assert target is not None
    flight = decoding(5, now)  # a batch well below the steady one
    kwargs = {"model": MODEL, "tenant": None, "prompt_tokens": 500, "now": now}
    today = off.forecast("r0", max_tokens=1000, in_flight=flight, **kwargs)  # type: ignore[arg-type]
    ahead = on.forecast("r0", max_tokens=1000, in_flight=flight, **kwargs)  # type: ignore[arg-type]
    assert target["decode_seqs"] > 50
    assert today.tpot_s < ahead.tpot_s < target["step_s"]
    assert ahead.ttft_s == today.ttft_s
    one_off = off.forecast("r0", max_tokens=1, in_flight=flight, **kwargs)  # type: ignore[arg-type]
    one_on = on.forecast("r0", max_tokens=1, in_flight=flight, **kwargs)  # type: ignore[arg-type]
    assert one_on == one_off
    assert math.isfinite(one_on.tpot_s)


def test_config_rejects_a_span_longer_than_the_memory() -> None:
    with pytest.raises(ValueError, match="arrival_min_span_s"):
        PredictionConfig(arrival_memory_s=10.0, arrival_min_span_s=20.0)
