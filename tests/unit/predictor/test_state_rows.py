"""``ReplicaState.from_rows`` (plain tuples) builds exactly the state ``from_sequences`` does."""

from __future__ import annotations

import random

import pytest

from predictor import (
    GPUS,
    MODELS,
    CandidateRequest,
    ForecastReason,
    ReplicaState,
    RunningSeq,
    forecast_request,
    roofline_prior,
)

LIMITS = {
    "kv_capacity_tokens": 400_000,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "max_model_len": 8192,
}


@pytest.mark.parametrize("running", [0, 1, 7, 300])
def test_rows_and_sequences_give_the_same_state(running: int) -> None:
    rng = random.Random(running)
    rows: list[tuple[int, int, int, float]] = []
    for _ in range(running):
        prompt = rng.randint(1, 4000)
        computed = rng.choice([prompt, prompt, rng.randint(0, prompt)])  # most have finished prefill
        rows.append((prompt, computed, rng.randint(0, 500), rng.uniform(0.0, 900.0)))
    waiting = [rng.randint(1, 3000) for _ in range(running % 4)]
    extra = {"background_prefill_tokens_per_step": 12.0, "stale": True, "step_remaining_s": 0.004}
    from_rows = ReplicaState.from_rows(rows, waiting, **LIMITS, **extra)  # type: ignore[arg-type]
    seqs = [RunningSeq(*row) for row in rows]
    assert from_rows == ReplicaState.from_sequences(seqs, waiting, **LIMITS, **extra)  # type: ignore[arg-type]
    assert from_rows.num_running == running
    assert len(from_rows.release_steps) == running


def test_a_states_check_is_kept_and_answers_every_forecast_alike() -> None:
    request = CandidateRequest(500, 100, 200.0)
    good = ReplicaState.from_rows(
        [(1000, 1000, 10, 300.0)],
        [],
        kv_capacity_tokens=400_000,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
    )
    bad = ReplicaState(2, 0, 3, 1000, 400_000, 256, 8192, 8192)  # more decoding than running
    model = roofline_prior(MODELS["Llama-3-8B"], GPUS["H100-SXM"])
    for _ in range(2):  # the second forecast on each state uses the kept check
        assert forecast_request(request, good, model).valid
        assert forecast_request(request, bad, model).reason == ForecastReason.BAD_STATE
        too_long = CandidateRequest(8000, 1000, 200.0)  # the request's own checks still run
        assert forecast_request(too_long, good, model).reason == ForecastReason.EXCEEDS_MAX_MODEL_LEN
