"""TTFT / TPOT forecasts: chunked prefill under the step budget, decodes sharing steps, the stall a
long prompt inflicts, full replicas, and inputs that cannot be forecast."""

from __future__ import annotations

import dataclasses
import math

import pytest

from predictor.forecast import Forecast, ForecastConfig, forecast_request, prefill_share
from predictor.forecast_inputs import CandidateRequest, ForecastReason, ReplicaState, RunningSeq
from predictor.hardware import GPUS
from predictor.model import MODELS
from predictor.step_model import StepBatch, StepModel, roofline_prior, unknown_step_model
from tests.unit.predictor.reference_engine import simulate_ttft

MODEL = roofline_prior(MODELS["Llama-3-8B"], GPUS["H100-SXM"])
BIG = 10**7


def state_of(
    contexts: list[int],
    queue: list[int],
    *,
    budget: int = 8192,
    max_num_seqs: int = 1024,
    kv_capacity: int = BIG,
    **overrides: object,
) -> ReplicaState:
    """A replica whose running requests decode with ``contexts``, waiting prompts ``queue``."""
    state = ReplicaState(
        num_running=len(contexts),
        num_waiting=len(queue),
        decode_seqs=len(contexts),
        kv_tokens_in_use=sum(contexts),
        kv_capacity_tokens=kv_capacity,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=BIG,
        queued_prefill_tokens=sum(queue),
        queued_requests=len(queue),
        queued_prefill_attn_pairs=sum(p * p / 2 for p in queue),
    )
    return dataclasses.replace(state, **overrides)  # type: ignore[arg-type]


def request(prompt: int, output: float = 100.0, max_tokens: int = 1000, **kw: object) -> CandidateRequest:
    return CandidateRequest(prompt, max_tokens, output, **kw)  # type: ignore[arg-type]


def chunked_prefill_time(model: StepModel, prompt: int, budget: int) -> float:
    """Sum over the prompt's chunks of the step time of a step carrying only that chunk."""
    total, done = 0.0, 0
    while done < prompt:
        chunk = min(budget, prompt - done)
        total += model.step_time(
            StepBatch(prefill_tokens=chunk, prefill_attn_pairs=chunk * (chunk / 2 + done))
        )
        done += chunk
    return total


@pytest.mark.parametrize(
    ("prompt", "budget", "steps"),
    [
        (1, 8192, 1),
        (500, 8192, 1),
        (8192, 8192, 1),
        (8193, 8192, 2),
        (20_000, 8192, 3),
        (20_000, 2048, 10),
        (100_000, 8192, 13),
    ],
    ids=["one-token", "short", "exactly-one-budget", "one-over-budget", "20k", "20k-small-budget", "100k"],
)
def test_empty_replica_ttft_is_its_own_prefill_chunks(prompt: int, budget: int, steps: int) -> None:
    f = forecast_request(request(prompt), state_of([], [], budget=budget), MODEL)
    assert f.valid
    assert f.reason is None
    assert f.prefill_steps == steps
    assert f.ttft_s == pytest.approx(chunked_prefill_time(MODEL, prompt, budget), rel=1e-9)
    assert f.admission_wait_s == 0.0
    assert f.inflicted_stall_s == 0.0
    assert f.inflicted_tpot_s == 0.0


@pytest.mark.parametrize(
    "queue", [[3000], [3000, 9000], [500] * 20], ids=["one-ahead", "two-ahead", "twenty-ahead"]
)
def test_queue_ahead_adds_its_chunks(queue: list[int]) -> None:
    prompt, budget = 4000, 8192
    alone = forecast_request(request(prompt), state_of([], [], budget=budget), MODEL)
    behind = forecast_request(request(prompt), state_of([], queue, budget=budget), MODEL)
    assert behind.ttft_s > alone.ttft_s
    assert behind.prefill_steps == math.ceil((sum(queue) + prompt) / budget)
    # The same work step by step; the closed form lets the queue's requests join the decodes
    # halfway on average instead of as each completes, hence not exact.
    reference, _, _ = simulate_ttft(MODEL, budget, [], queue, prompt)
    assert behind.ttft_s == pytest.approx(reference, rel=0.005)


@pytest.mark.parametrize(
    ("decodes", "prompt", "budget"),
    [(0, 20_000, 8192), (64, 20_000, 8192), (512, 20_000, 2048), (2000, 5000, 2048)],
    ids=["no-decodes", "64-decodes", "512-decodes-small-budget", "decodes-eat-the-budget"],
)
def test_decodes_take_their_tokens_from_every_step(decodes: int, prompt: int, budget: int) -> None:
    contexts = [1000] * decodes
    f = forecast_request(request(prompt), state_of(contexts, [], budget=budget, max_num_seqs=4096), MODEL)
    assert f.prefill_steps == math.ceil(prompt / max(1, budget - decodes))
    alone = forecast_request(request(prompt), state_of([], [], budget=budget), MODEL)
    assert f.ttft_s >= alone.ttft_s


# The closed form against a step-by-step engine running the same step model.
@pytest.mark.parametrize(
    ("contexts", "queue", "prompt", "budget"),
    [
        ([1000] * 64, [], 20_000, 8192),
        ([2000] * 200, [3000] * 5, 5000, 2048),
        ([500] * 32, [100_000], 1000, 8192),
        ([1000] * 64, [], 100_000, 8192),
        ([4000] * 250, [700] * 40, 2000, 2048),
        ([300] * 8, [50] * 3, 40, 512),
    ],
    ids=[
        "64-decodes",
        "200-decodes-5-queued",
        "behind-a-100k-prompt",
        "100k-prompt",
        "busy-small-budget",
        "tiny",
    ],
)
def test_closed_form_matches_step_by_step_engine(
    contexts: list[int], queue: list[int], prompt: int, budget: int
) -> None:
    ttft, steps, stall = simulate_ttft(MODEL, budget, contexts, queue, prompt)
    f = forecast_request(request(prompt), state_of(contexts, queue, budget=budget), MODEL)
    assert f.prefill_steps == steps
    assert f.ttft_s == pytest.approx(ttft, rel=0.01)
    # Near the knee the halfway-joined queue moves the hinge by a few tokens: abs slack of 0.1 ms.
    assert f.inflicted_stall_s == pytest.approx(stall, rel=0.01, abs=1e-4)


def test_stall_on_running_decodes_grows_with_prompt_length() -> None:
    state = state_of([1500] * 64, [], mean_remaining_output_tokens=200.0)
    forecasts = [forecast_request(request(p), state, MODEL) for p in (1000, 8000, 32_000, 100_000)]
    stalls = [f.inflicted_stall_s for f in forecasts]
    inflicted = [f.inflicted_tpot_s for f in forecasts]
    assert stalls == sorted(stalls)
    assert len(set(stalls)) == 4
    assert inflicted == sorted(inflicted)
    assert len(set(inflicted)) == 4
    # A 100K prompt at (8192 - 64) tokens per step slows 13 steps of every running stream.
    assert forecasts[-1].prefill_steps == 13
    assert forecasts[-1].inflicted_stall_s > 1.0  # seconds added to each running stream's timeline
    # Averaged over the 200-token window the stall dominates the extra TPOT.
    assert forecasts[-1].inflicted_tpot_s >= forecasts[-1].inflicted_stall_s / 200.0


def test_tpot_is_the_step_time_of_the_batch_it_joins() -> None:
    contexts, prompt, output = [2000] * 100, 1000, 300.0
    f = forecast_request(request(prompt, output), state_of(contexts, []), MODEL)
    joined = StepBatch(decode_seqs=101, kv_tokens_read=sum(contexts) + prompt + output / 2)
    assert f.tpot_s == pytest.approx(MODEL.step_time(joined), rel=1e-9)


@pytest.mark.parametrize("sequences", [2, 4, 16])
def test_several_sequences_join_the_batch_together(sequences: int) -> None:
    """A list of prompts or ``n`` choices decodes ``sequences`` at once: the batch it joins holds
    all of them with their contexts, and what it costs the running streams grows with them."""
    contexts, prompt, output = [2000] * 100, 1000, 300.0
    one = forecast_request(request(prompt, output), state_of(contexts, []), MODEL)
    many = forecast_request(request(prompt, output, sequences=sequences), state_of(contexts, []), MODEL)
    joined = StepBatch(
        decode_seqs=100 + sequences, kv_tokens_read=sum(contexts) + prompt + sequences * output / 2
    )
    assert many.tpot_s == pytest.approx(MODEL.step_time(joined), rel=1e-9)
    assert many.tpot_s > one.tpot_s
    assert many.inflicted_tpot_s > one.inflicted_tpot_s
    assert many.ttft_s == pytest.approx(one.ttft_s, rel=1e-9)  # the same prompt tokens to prefill
    # One sequence is the default, to the last bit.
    assert forecast_request(request(prompt, output, sequences=1), state_of(contexts, []), MODEL) == one


def test_several_sequences_need_their_slots_and_kv() -> None:
    # Two free sequence slots: one sequence starts at once, four wait for running ones to finish.
    state = state_of([2000] * 6, [], max_num_seqs=8)
    assert forecast_request(request(500, sequences=1), state, MODEL).admission_wait_s == 0.0
    assert forecast_request(request(500, sequences=4), state, MODEL).admission_wait_s > 0.0
    # KV for every sequence's output: four 400-token outputs do not fit 1,500 tokens of KV; one does.
    small = state_of([], [], kv_capacity=1500)
    assert forecast_request(request(200, 400.0), small, MODEL).valid
    assert forecast_request(request(200, 400.0, sequences=4), small, MODEL).reason == (
        ForecastReason.EXCEEDS_KV_CAPACITY
    )
    assert (
        forecast_request(request(200, 300.0, sequences=0), small, MODEL).reason == ForecastReason.BAD_REQUEST
    )


@pytest.mark.parametrize(
    ("small", "large"),
    [
        (state_of([1000] * 16, []), state_of([1000] * 256, [])),
        (state_of([500] * 64, []), state_of([8000] * 64, [])),
        (state_of([1000] * 64, []), state_of([1000] * 64, [], background_prefill_tokens_per_step=2000.0)),
    ],
    ids=["bigger-batch", "longer-contexts", "background-prefill"],
)
def test_tpot_grows_with_load(small: ReplicaState, large: ReplicaState) -> None:
    assert (
        forecast_request(request(500), large, MODEL).tpot_s
        > forecast_request(request(500), small, MODEL).tpot_s
    )


def _decode_step(state: ReplicaState) -> float:
    return MODEL.step_time(StepBatch(decode_seqs=state.decode_seqs, kv_tokens_read=state.kv_tokens_in_use))


@pytest.mark.parametrize(
    ("overrides", "prompt", "release_index", "approx_steps"),
    [
        ({"max_num_seqs": 4}, 100, 0, None),  # no free slot: the first finisher frees one
        (
            {"max_num_seqs": 4, "num_waiting": 1, "queued_requests": 1, "queued_prefill_tokens": 50},
            100,
            1,
            None,
        ),
        ({"kv_capacity_tokens": 4000 + 500}, 2000, 1, None),  # KV short by 1500: two must finish
        (
            {
                "max_num_seqs": 4,
                "release_steps": (),
                "release_kv_cumulative": (),
                "mean_remaining_output_tokens": 100.0,
            },
            100,
            None,
            100.0 * (1 / 4),  # memoryless: the first of 4 finishes after mean / 4 steps
        ),
    ],
    ids=["seq-slots-full", "slots-full-with-one-waiting-ahead", "kv-full", "seq-slots-full-memoryless"],
)
def test_full_replica_waits_for_running_requests_to_finish(
    overrides: dict[str, object], prompt: int, release_index: int | None, approx_steps: float | None
) -> None:
    base = state_of(
        [1000] * 4,
        [],
        release_steps=(10.0, 50.0, 100.0, 200.0),
        release_kv_cumulative=(1000.0, 2000.0, 3000.0, 4000.0),
        mean_remaining_output_tokens=90.0,
    )
    state = dataclasses.replace(base, **overrides)  # type: ignore[arg-type]
    f = forecast_request(request(prompt, 10), state, MODEL)
    not_full = forecast_request(request(prompt, 10), base, MODEL)
    assert f.valid
    assert not_full.admission_wait_s == 0.0
    if release_index is not None:
        expected = state.release_steps[release_index] * _decode_step(state)
        assert f.admission_wait_s == pytest.approx(expected, rel=1e-9)
    else:
        assert approx_steps is not None
        assert f.admission_wait_s == pytest.approx(approx_steps * _decode_step(state), rel=0.05)
    assert f.ttft_s > not_full.ttft_s
    assert f.ttft_s >= f.admission_wait_s


@pytest.mark.parametrize(
    ("req", "state", "reason"),
    [
        (request(0), state_of([], []), ForecastReason.BAD_REQUEST),
        (request(10, max_tokens=0), state_of([], []), ForecastReason.BAD_REQUEST),
        (request(10, output=math.nan), state_of([], []), ForecastReason.BAD_REQUEST),
        (request(10, output=-1.0), state_of([], []), ForecastReason.BAD_REQUEST),
        (request(10, cached_prompt_tokens=-1), state_of([], []), ForecastReason.BAD_REQUEST),
        (request(10), state_of([], [], max_num_seqs=0), ForecastReason.BAD_STATE),
        (request(10), state_of([], [], budget=0), ForecastReason.BAD_STATE),
        (request(10), state_of([100], [], decode_seqs=2), ForecastReason.BAD_STATE),
        (request(10), state_of([100], [], kv_tokens_in_use=-5), ForecastReason.BAD_STATE),
        (request(10), state_of([100], [], release_steps=(1.0,)), ForecastReason.BAD_STATE),
        (
            request(1000, max_tokens=100),
            state_of([], [], max_model_len=1024),
            ForecastReason.EXCEEDS_MAX_MODEL_LEN,
        ),
        (request(1000, output=500), state_of([], [], kv_capacity=1200), ForecastReason.EXCEEDS_KV_CAPACITY),
    ],
    ids=[
        "empty-prompt",
        "zero-max-tokens",
        "nan-output",
        "negative-output",
        "negative-cache-hits",
        "zero-max-num-seqs",
        "zero-budget",
        "more-decodes-than-running",
        "negative-kv",
        "release-lengths-differ",
        "over-max-model-len",
        "never-fits-in-kv",
    ],
)
def test_inputs_that_cannot_be_forecast(
    req: CandidateRequest, state: ReplicaState, reason: ForecastReason
) -> None:
    f = forecast_request(req, state, MODEL)
    assert not f.valid
    assert f.reason == reason
    assert math.isnan(f.ttft_s)
    assert math.isnan(f.tpot_s)
    assert math.isnan(f.inflicted_tpot_s)


def test_unknown_step_model_gives_no_numbers() -> None:
    f = forecast_request(request(100), state_of([], []), unknown_step_model("unknown hardware"))
    assert (f.valid, f.reason) == (False, ForecastReason.NO_STEP_MODEL)
    assert math.isnan(f.ttft_s)


def test_stale_state_is_computed_but_flagged() -> None:
    fresh = forecast_request(request(100), state_of([500] * 8, []), MODEL)
    stale = forecast_request(request(100), state_of([500] * 8, [], stale=True), MODEL)
    assert (stale.valid, stale.reason) == (False, ForecastReason.STALE_STATE)
    assert stale.ttft_s == fresh.ttft_s
    assert math.isfinite(stale.tpot_s)


@pytest.mark.parametrize(
    ("expected", "max_tokens", "used"),
    [(300.0, 1000, 300.0), (3000.0, 1000, 1000.0), (0.0, 1000, 1.0)],
    ids=["as-predicted", "capped-at-max-tokens", "at-least-one"],
)
def test_output_tokens_used_and_quantile_are_reported(expected: float, max_tokens: int, used: float) -> None:
    f = forecast_request(request(100, expected, max_tokens, output_quantile=0.9), state_of([], []), MODEL)
    assert f.output_tokens_used == used
    assert f.output_quantile == 0.9


def test_prefix_cache_hits_shorten_ttft() -> None:
    state = state_of([1000] * 32, [])
    cold = forecast_request(request(16_000), state, MODEL)
    warm = forecast_request(request(16_000, cached_prompt_tokens=12_000), state, MODEL)
    fully = forecast_request(request(16_000, cached_prompt_tokens=16_000), state, MODEL)
    assert fully.ttft_s < warm.ttft_s < cold.ttft_s
    assert fully.prefill_steps == 1  # the last token is always computed


def test_inflicted_window_comes_from_config_when_state_does_not_say() -> None:
    state = state_of([1500] * 64, [])
    short = forecast_request(request(50_000), state, MODEL, ForecastConfig(default_window_tokens=64))
    long = forecast_request(request(50_000), state, MODEL, ForecastConfig(default_window_tokens=1024))
    assert short.inflicted_stall_s == long.inflicted_stall_s
    assert short.inflicted_tpot_s > long.inflicted_tpot_s


def test_state_from_sequences_aggregates_detail() -> None:
    running = [
        RunningSeq(prompt_tokens=1000, computed_tokens=1000, generated_tokens=10, expected_output_tokens=110),
        RunningSeq(prompt_tokens=500, computed_tokens=500, generated_tokens=300, expected_output_tokens=310),
        RunningSeq(prompt_tokens=4000, computed_tokens=1000, generated_tokens=0, expected_output_tokens=50),
    ]
    state = ReplicaState.from_sequences(
        running,
        [300, 700],
        kv_capacity_tokens=100_000,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_model_len=8192,
    )
    assert (state.num_running, state.num_waiting, state.decode_seqs) == (3, 2, 2)
    assert state.kv_tokens_in_use == 1010 + 800 + 1000
    assert (state.queued_prefill_tokens, state.queued_requests) == (3000 + 300 + 700, 3)
    assert state.queued_prefill_attn_pairs == pytest.approx(3000 * (1500 + 1000) + 300 * 150 + 700 * 350)
    assert state.release_steps == (10.0, 50.0, 100.0)
    assert state.release_kv_cumulative == (800.0, 1800.0, 2810.0)
    assert state.mean_remaining_output_tokens == pytest.approx(160 / 3)
    f = forecast_request(request(200), state, MODEL)
    assert f.valid
    assert f.prefill_steps >= 2


@pytest.mark.parametrize(
    ("remaining", "contexts", "queue"),
    [(0.0, [], []), (0.004, [1000] * 8, []), (0.050, [1000] * 64, [2000])],
    ids=["idle", "mid-decode-step", "long-step-with-queue"],
)
def test_step_in_progress_delays_the_first_token(
    remaining: float, contexts: list[int], queue: list[int]
) -> None:
    base = state_of(contexts, queue)
    waiting = dataclasses.replace(base, step_remaining_s=remaining)
    f0, f1 = forecast_request(request(500), base, MODEL), forecast_request(request(500), waiting, MODEL)
    assert f1.ttft_s == pytest.approx(f0.ttft_s + remaining, rel=1e-12)
    assert (f1.step_wait_s, f1.tpot_s) == (remaining, f0.tpot_s)


@pytest.mark.parametrize("share", [0.0, 0.25, 0.6], ids=["no-prefill", "quarter", "most"])
def test_measured_prefill_share_stretches_the_decode_steps(share: float) -> None:
    contexts, prompt, output = [2000] * 50, 1000, 200.0
    state = state_of(contexts, [], prefill_share=share, background_prefill_tokens_per_step=5000.0)
    f = forecast_request(request(prompt, output), state, MODEL)
    decode = MODEL.step_time(StepBatch(decode_seqs=51, kv_tokens_read=sum(contexts) + prompt + output / 2))
    # The measured share replaces the modelled background prefill entirely.
    assert f.tpot_s == pytest.approx(decode / (1.0 - share), rel=1e-9)


@pytest.mark.parametrize(
    ("itl_s", "expected"),
    [(None, None), (0.010, 0.0), (0.040, None), (10.0, 0.95)],
    ids=["model-invalid", "itl-below-decode-step", "quarter-decode", "clamped"],
)
def test_prefill_share_from_measured_itl(itl_s: float | None, expected: float | None) -> None:
    decode = MODEL.step_time(StepBatch(decode_seqs=64, kv_tokens_read=64_000))
    if itl_s is None:
        assert prefill_share(unknown_step_model("x"), 0.02, 64, 64_000) is None
        return
    got = prefill_share(MODEL, itl_s, 64, 64_000)
    assert got == pytest.approx(expected if expected is not None else 1.0 - decode / itl_s)


@pytest.mark.parametrize(
    ("queue", "need", "rate"),
    [([], 1, 10.0), ([1000] * 9, 10, 10.0), ([1000] * 9, 10, 20.0)],
    ids=["alone-behind-full-batch", "nine-ahead", "nine-ahead-faster-finishes"],
)
def test_full_replica_admits_one_waiting_request_per_finished_one(
    queue: list[int], need: int, rate: float
) -> None:
    # KV full: every request ahead (and this one) waits for one running request to finish.
    contexts = [1000] * 100
    state = state_of(contexts, queue, kv_capacity=sum(contexts), finish_rate_per_s=rate)
    f = forecast_request(request(1000), state, MODEL)
    assert f.admission_wait_s == pytest.approx(need / rate, rel=1e-9)
    # The queue ahead is prefilled during the wait: what is left is its own prefill step.
    alone = forecast_request(request(1000), state_of(contexts, []), MODEL)
    assert f.ttft_s - f.admission_wait_s == pytest.approx(alone.ttft_s, rel=1e-9)


@pytest.mark.parametrize(
    ("recent", "capacity", "rate"),
    [(4.0, 10.0, 10.0), (10.0, 4.0, 10.0), (None, 10.0, 10.0), (4.0, None, 4.0)],
    ids=["quiet-window-known-capacity", "capacity-below-the-window", "no-window-rate", "no-capacity"],
)
def test_a_full_replica_frees_its_slots_at_its_capacity_if_the_window_was_quieter(
    recent: float | None, capacity: float | None, rate: float
) -> None:
    """The window's finish rate counts the time the replica was not full (after a quiet spell,
    the quiet traffic's rate): a full replica frees a slot per finished request at the larger of
    that and its capacity (its finish rate while full)."""
    contexts, queue = [1000] * 100, [1000] * 9
    state = state_of(
        contexts,
        queue,
        kv_capacity=sum(contexts),
        finish_rate_per_s=recent,
        full_finish_rate_per_s=capacity,
    )
    f = forecast_request(request(1000), state, MODEL)
    assert f.admission_wait_s == pytest.approx(10 / rate, rel=1e-9)


def test_capacity_does_not_touch_a_replica_with_room() -> None:
    """Not full, nothing waits for a slot: the capacity changes nothing."""
    contexts = [1000] * 10
    plain = forecast_request(request(1000), state_of(contexts, [], finish_rate_per_s=2.0), MODEL)
    known = state_of(contexts, [], finish_rate_per_s=2.0, full_finish_rate_per_s=50.0)
    assert forecast_request(request(1000), known, MODEL) == plain


def test_full_replica_with_a_long_queue_is_bound_by_prefill_instead() -> None:
    # 60 prompts of 2000 tokens ahead take ~15 full steps to prefill, longer than 60 finishes at
    # 100 per second: the prefill throughput binds, and the forecast says so.
    contexts, queue = [1000] * 100, [2000] * 60
    bound = state_of(contexts, queue, kv_capacity=sum(contexts), finish_rate_per_s=100.0)
    unbound = state_of(contexts, queue)
    f, through = (
        forecast_request(request(1000), bound, MODEL),
        forecast_request(request(1000), unbound, MODEL),
    )
    assert f.admission_wait_s == 0.0
    assert f.ttft_s == pytest.approx(through.ttft_s, rel=1e-9)
    assert f.ttft_s > 61 / 100.0


def test_joined_batch_never_exceeds_the_kv_cache() -> None:
    # 500 queued requests could never all decode at once in a 100K-token cache.
    contexts = [1000] * 50
    state = state_of(contexts, [1000] * 500, kv_capacity=100_000, finish_rate_per_s=20.0)
    f = forecast_request(request(1000, 100), state, MODEL)
    biggest = MODEL.step_time(StepBatch(decode_seqs=1024, kv_tokens_read=100_000))
    assert f.valid
    assert f.tpot_s < biggest


def _gemm(tokens: float) -> float:
    """The step model's GEMM time of ``tokens`` batched tokens (no KV read, no attention)."""
    return MODEL.step_time(StepBatch(prefill_tokens=tokens)) - MODEL.step_time(StepBatch())


@pytest.mark.parametrize(
    ("rate", "remaining", "riders"),
    [
        (0.0, 0.050, 0.0),
        # half the 20,000 tokens/s expected over the 50 ms wait share the 500-token step
        (20_000.0, 0.050, 500.0),
        # at most the budget left in that step: 8192 - 500
        (1e7, 0.050, 7692.0),
        (20_000.0, 0.0, 0.0),
    ],
    ids=["no-arrivals", "half-the-expected", "at-most-the-room-left", "no-wait"],
)
def test_prompts_arriving_before_its_prefill_step_ride_in_it(
    rate: float, remaining: float, riders: float
) -> None:
    quiet = state_of([], [], step_remaining_s=remaining)
    busy = dataclasses.replace(quiet, arriving_prompt_tokens_per_s=rate)
    f0, f1 = forecast_request(request(500), quiet, MODEL), forecast_request(request(500), busy, MODEL)
    assert f1.ttft_s - f0.ttft_s == pytest.approx(_gemm(500 + riders) - _gemm(500), abs=1e-12)
    assert f1.tpot_s == f0.tpot_s
    assert f1.prefill_batch is not None
    assert f1.prefill_batch.prefill_tokens == pytest.approx(500 + riders)


@pytest.mark.parametrize(
    ("contexts", "queue", "prompt"),
    [([], [], 500), ([1000] * 32, [], 2000), ([1000] * 32, [3000, 800], 700), ([500] * 8, [], 20_000)],
    ids=["alone", "with-decodes", "with-queue", "chunked"],
)
def test_prefill_batch_is_what_the_prefill_part_of_ttft_prices(
    contexts: list[int], queue: list[int], prompt: int
) -> None:
    f = forecast_request(request(prompt), state_of(contexts, queue), MODEL)
    assert f.prefill_batch is not None
    assert f.prefill_batch.prefill_tokens * f.prefill_steps == pytest.approx(sum(queue) + prompt)
    if f.prefill_steps == 1:  # one step: its mean composition is the step itself
        assert f.ttft_s == pytest.approx(MODEL.step_time(f.prefill_batch), rel=1e-9)


@pytest.mark.parametrize(
    ("waiting", "waves"),
    [(3, 0.0), (4, 0.25), (8, 1.25)],
    ids=["queue-within-running-set", "one-beyond-running-set", "queue-twice-the-running-set"],
)
def test_a_queue_longer_than_the_running_set_waits_for_later_waves(waiting: int, waves: float) -> None:
    """4 running, ``waiting`` queued ahead: beyond the 4th finisher, each further 4 take one
    more full output (the longest remaining output, 200 steps)."""
    state = state_of(
        [1000] * 4,
        [50] * waiting,
        max_num_seqs=4,
        release_steps=(10.0, 50.0, 100.0, 200.0),
        release_kv_cumulative=(1000.0, 2000.0, 3000.0, 4000.0),
        mean_remaining_output_tokens=90.0,
    )
    f = forecast_request(request(100, 10), state, MODEL)
    need = min(4, waiting + 1)
    expected_steps = state.release_steps[need - 1] + waves * 200.0
    assert f.admission_wait_s == pytest.approx(expected_steps * _decode_step(state), rel=1e-9)


def test_with_overhead_replaces_three_fields_and_keeps_every_other() -> None:
    """``Forecast.with_overhead`` (the constructor, not ``dataclasses.replace``) changes the TTFT,
    the overhead and the time made and keeps every other field: each field set to a value of its
    own, so a field added to ``Forecast`` and not copied fails this."""
    special: dict[str, object] = {
        "valid": True,
        "reason": "stale_state",
        "prefill_steps": 7,
        "prefill_batch": StepBatch(11.0, 12.0, 13.0, 14.0),
    }
    values = {f.name: special.get(f.name, 0.5 + i) for i, f in enumerate(dataclasses.fields(Forecast))}
    original = Forecast(**values)  # type: ignore[arg-type]
    moved = original.with_overhead(0.25, 0.125, 99.0)
    assert moved == dataclasses.replace(original, ttft_s=0.25, overhead_s=0.125, made_at=99.0)
