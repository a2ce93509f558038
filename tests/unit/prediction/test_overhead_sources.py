"""Where the dispatch overhead's "replica's own TTFT" comes from, and who learns it.

The replica's TTFT histogram where it has one (vLLM, SGLang); TGI has none, so its queue time plus
its prefill step (TGI's own dashboard's TTFT). The live gateway learns the overhead; the
virtual-time replay, which has no transport, does not.
"""

from __future__ import annotations

import numpy as np
import pytest

from gateway.app import LIVE_PREDICTION, build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.keys import PREDICTION_SERVICE
from gateway.prediction import PredictionConfig, PredictionService, ReplicaFacts
from gateway.replicas.config import ReplicaSettings
from gateway.replicas.snapshot import ReplicaSnapshot
from predictor import Forecast, StepBatch
from predictor.overhead import steps_waited_s
from replay import ReplayConfig

H100 = ReplicaFacts(
    gpu="H100-SXM",
    model="meta-llama/Meta-Llama-3-8B-Instruct",
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    max_model_len=8192,
)
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def _learned_overhead_s(
    gateway_ttft_s: float,
    svc: PredictionService | None = None,
    *,
    ttft: float | None = None,
    queue: float | None = None,
    prefill: float | None = None,
    request_prefill: float | None = None,
) -> float:
    """The overhead ``svc`` (by default one that learns it) learned over 40 one-second windows of
    12 requests each (EWMA from 0)."""
    svc = svc or PredictionService(config=PredictionConfig(learn_dispatch_overhead=True))
    svc.set_replica("r0", H100)
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
        svc.on_snapshot(
            ReplicaSnapshot(
                name="r0",
                taken_at=float(second),
                metrics_at=float(second),
                window_s=10.0,
                ttft_mean_s=ttft,
                queue_time_mean_s=queue,
                prefill_step_time_mean_s=prefill,
                request_prefill_step_time_mean_s=request_prefill,
            )
        )
    replicas = svc.describe()["replicas"]
    assert isinstance(replicas, dict)
    overhead = replicas["r0"]["dispatch_overhead_s"]
    assert isinstance(overhead, float)
    return overhead


def test_tgi_without_a_ttft_histogram_gives_queue_time_plus_its_prefill_step() -> None:
    # TGI: 4 ms in its queue, an 11 ms prefill step; the gateway measured 19 ms.
    learned = _learned_overhead_s(0.019, queue=0.004, prefill=0.011)
    assert learned == pytest.approx(0.004, abs=1e-4)


def test_tgi_prefill_step_weighted_by_the_requests_it_started() -> None:
    """A prefill step several requests shared counts once in TGI's step mean but once per request
    in their TTFTs: the request-weighted mean, when the scrape has it, is the replica's own TTFT's
    part (unweighted, the overhead came out that much too long)."""
    learned = _learned_overhead_s(0.019, queue=0.004, prefill=0.011, request_prefill=0.0125)
    assert learned == pytest.approx(0.0025, abs=1e-4)


def test_the_ttft_histogram_wins_over_the_tgi_proxy() -> None:
    learned = _learned_overhead_s(0.019, ttft=0.017, queue=0.004, prefill=0.011)
    assert learned == pytest.approx(0.002, abs=1e-4)


@pytest.mark.parametrize(
    ("queue", "prefill"),
    [(0.004, None), (None, 0.011), (None, None)],
    ids=["queue-only (vLLM without TTFT in the window)", "prefill-only", "nothing"],
)
def test_nothing_is_learned_without_the_replicas_own_ttft(queue: float | None, prefill: float | None) -> None:
    assert _learned_overhead_s(0.019, queue=queue, prefill=prefill) == 0.0


def test_the_live_gateway_learns_it_and_the_default_does_not() -> None:
    """``build_app``'s service learns it; ``PredictionConfig``'s default (the replay's) does not."""
    settings = Settings(replicas=[ReplicaSettings(name="r0", url="http://127.0.0.1:9")])
    app = build_app(SettingsStore(settings), spawn_emulators=False)
    assert LIVE_PREDICTION.learn_dispatch_overhead
    live = _learned_overhead_s(0.019, app[PREDICTION_SERVICE], ttft=0.017)
    assert live == pytest.approx(0.002, abs=1e-4)
    assert ReplayConfig.__dataclass_fields__["prediction"].default is None
    assert _learned_overhead_s(0.019, PredictionService(), ttft=0.017) == 0.0


def test_with_overhead_adds_what_was_learned_to_a_forecast_made_elsewhere() -> None:
    """Admission forecasts with ``replica_inputs`` itself; ``with_overhead`` adds the overhead."""
    svc = PredictionService(config=PredictionConfig(learn_dispatch_overhead=True))
    _learned_overhead_s(0.019, svc, ttft=0.016)
    engine = Forecast(0.02, 0.01, 0.0, True, None, 50.0, 0.5)
    shown = svc.with_overhead("r0", engine, 41.0)
    assert shown.overhead_s == pytest.approx(0.003, abs=1e-4)
    assert shown.ttft_s == pytest.approx(0.02 + shown.overhead_s)
    assert (shown.tpot_s, shown.made_at) == (engine.tpot_s, 41.0)
    unknown = svc.with_overhead("elsewhere", engine, 41.0)
    assert (unknown.ttft_s, unknown.overhead_s, unknown.made_at) == (0.02, 0.0, 41.0)


def test_the_overhead_is_corrected_with_the_ttft_and_not_spread() -> None:
    """A forecast the correction scaled (``ttft_factor``) has the overhead scaled with it; the
    spread admission judged it at (``ttft_spread``) stays out of the TTFT shown, a median."""
    svc = PredictionService(config=PredictionConfig(learn_dispatch_overhead=True))
    _learned_overhead_s(0.019, svc, ttft=0.016)
    engine = Forecast(0.04, 0.01, 0.0, True, None, 50.0, 0.5, ttft_factor=2.0, ttft_spread=1.5)
    shown = svc.with_overhead("r0", engine, 41.0)
    assert shown.overhead_s == pytest.approx(0.003, abs=1e-4)
    assert shown.ttft_s == pytest.approx(0.04 + 2.0 * shown.overhead_s)
    assert shown.ttft_spread == 1.5


@pytest.mark.parametrize(
    ("step_wait_s", "decode_seqs", "steps"),
    [(0.005, 3.0, 0.0), (0.003, 3.0, 0.5), (0.001, 3.0, 1.0), (0.0, 3.0, 1.0), (0.002, 0.0, 5.0 / 6.0)],
    ids=[
        "busy, in time for the step in progress however late it gets there",
        "busy, just in time on average: half a step",
        "busy, too late: waits for the next step too",
        "busy, step overdue: its tokens are landing, the next one runs without it",
        "a prefill-only step in progress, most likely too late",
    ],
)
def test_on_a_busy_engine_the_overhead_decides_which_step_the_request_catches(
    step_wait_s: float, decode_seqs: float, steps: float
) -> None:
    """The step wait is counted from tokens the gateway saw land (the way back is in it): a request
    whose way in (the learned overhead, 3 ms here, give or take half of it) is shorter than the
    wait catches the step in progress and nothing is added; a later one waits one more decode step
    of the batch it joins; in between, the chance of either."""
    svc = PredictionService(config=PredictionConfig(learn_dispatch_overhead=True))
    _learned_overhead_s(0.019, svc, ttft=0.016)
    batch = StepBatch(300.0, decode_seqs, 3000.0 if decode_seqs else 0.0)
    engine = Forecast(0.02, 0.01, 0.0, True, None, 50.0, 0.5, step_wait_s=step_wait_s, prefill_batch=batch)
    shown = svc.with_overhead("r0", engine, 41.0)
    model, _ = svc.replica_inputs("r0", model=MODEL, tenant=None, in_flight=[], now=41.0)
    next_step = model.step_time(StepBatch(0.0, decode_seqs, batch.kv_tokens_read))
    assert next_step > 0.0045  # longer than the latest arrival: one step at most
    assert shown.overhead_s == pytest.approx(steps * next_step, abs=2e-5)
    assert shown.ttft_s == pytest.approx(0.02 + shown.overhead_s)
    assert shown.made_at == 41.0


@pytest.mark.parametrize(
    ("lo", "hi", "steps"),
    [
        (-2.0, -1.0, 0.0),
        (0.25, 0.75, 1.0),
        (0.5, 1.5, 1.5),
        (-1.0, 1.0, 0.5),
        (2.5, 2.5, 3.0),
        (0.0, 0.0, 0.0),
    ],
    ids=[
        "always in time",
        "always one step",
        "one or two",
        "in time or one",
        "exactly 2.5 late",
        "exactly on time",
    ],
)
def test_steps_waited_for_a_lateness_spread_uniformly(lo: float, hi: float, steps: float) -> None:
    assert steps_waited_s(lo * 0.008, hi * 0.008, 0.008) == pytest.approx(steps * 0.008)


def test_an_idle_engine_gets_the_whole_overhead() -> None:
    """No step in progress and nothing decoding: the prefill starts when the request gets there."""
    svc = PredictionService(config=PredictionConfig(learn_dispatch_overhead=True))
    _learned_overhead_s(0.019, svc, ttft=0.016)
    engine = Forecast(0.02, 0.01, 0.0, True, None, 50.0, 0.5, prefill_batch=StepBatch(300.0, 0.0, 0.0))
    shown = svc.with_overhead("r0", engine, 41.0)
    assert shown.overhead_s == pytest.approx(0.003, abs=1e-4)
    assert shown.ttft_s == pytest.approx(0.02 + shown.overhead_s)


def test_an_overhead_of_several_steps_costs_the_steps_it_spans() -> None:
    """A slow way in (an API server's own work on a busy CPU) is late by several steps: the
    request waits for the end of the step in progress when it gets there, about the lateness plus
    half a step on average."""
    svc = PredictionService(config=PredictionConfig(learn_dispatch_overhead=True))
    d = _learned_overhead_s(0.060, svc, ttft=0.016)  # 44 ms of overhead
    batch = StepBatch(300.0, 3.0, 3000.0)
    engine = Forecast(0.02, 0.01, 0.0, True, None, 50.0, 0.5, step_wait_s=0.002, prefill_batch=batch)
    shown = svc.with_overhead("r0", engine, 41.0)
    model, _ = svc.replica_inputs("r0", model=MODEL, tenant=None, in_flight=[], now=41.0)
    step = model.step_time(StepBatch(0.0, 3.0, 3000.0))
    late = np.linspace(d - 0.002 - d / 2, d - 0.002 + d / 2, 200_001)
    assert shown.overhead_s == pytest.approx(float(np.mean(np.ceil(late / step) * step)), rel=1e-4)
    assert shown.overhead_s == pytest.approx(0.042 + step / 2, abs=step / 4)


def _finish(svc: PredictionService, api: str | None, residual_s: float) -> None:
    """One finished request on ``r0`` through ``api`` whose TTFT came ``residual_s`` after its
    forecast's (an idle-engine forecast: no prefill steps to learn from)."""
    engine = Forecast(0.02, 0.01, 0.0, True, None, 50.0, 0.5, made_at=50.0)
    svc.on_finished(
        replica="r0",
        model=MODEL,
        tenant=None,
        prompt_chars=None,
        prompt_tokens=None,
        completion_tokens=None,
        forecast=engine,
        ttft_s=0.02 + residual_s,
        api=api,
    )


def test_an_apis_residual_is_reported_not_added_to_forecasts() -> None:
    """TGI behind one gateway, its native API beside its OpenAI one: the chat requests come 4 ms
    later than forecast, the native ones on time. Each API's residual against the replica's is
    reported (``describe``); the overhead forecasts add is the replica's, whatever the API (in
    the mixed fleet the difference was the engine's, not the way in: added, it made TGI's TTFT
    forecasts worse)."""
    svc = PredictionService(config=PredictionConfig(learn_dispatch_overhead=True))
    _learned_overhead_s(0.019, svc, ttft=0.016)  # 3 ms
    for _ in range(300):
        _finish(svc, "chat", 0.004)
        _finish(svc, "generate_stream", 0.0)
    assert svc.api_residual_s("r0", "chat") == pytest.approx(0.002, abs=2e-4)
    assert svc.api_residual_s("r0", "generate_stream") == pytest.approx(-0.002, abs=2e-4)
    idle = Forecast(0.02, 0.01, 0.0, True, None, 50.0, 0.5)
    assert svc.with_overhead("r0", idle, 60.0).overhead_s == pytest.approx(0.003, abs=1e-4)
    residuals = svc.describe()["replicas"]["r0"]["api_ttft_residuals_s"]  # type: ignore[index]
    assert set(residuals) == {"chat", "generate_stream"}
    assert residuals["chat"] == svc.api_residual_s("r0", "chat")


@pytest.mark.parametrize(
    ("apis", "requests", "expected_s"),
    [
        (["chat"], 300, 0.0),
        (["chat", "generate"], 10, 0.0),
    ],
    ids=["one API: its residual is the replica's", "too few requests yet"],
)
def test_no_api_residual_without_a_difference_to_measure(
    apis: list[str], requests: int, expected_s: float
) -> None:
    svc = PredictionService(config=PredictionConfig(learn_dispatch_overhead=True))
    _learned_overhead_s(0.019, svc, ttft=0.016)
    for i in range(requests):
        for k, api in enumerate(apis):
            _finish(svc, api, 0.004 + 0.002 * k + 0.001 * (i % 3))
    assert svc.api_residual_s("r0", "chat") == pytest.approx(expected_s, abs=1e-9)
    assert svc.api_residual_s("r0", None) == 0.0
    assert svc.api_residual_s("elsewhere", "chat") == 0.0
