"""What a replica's dispatch overhead adds to a TTFT forecast (``predictor.overhead``), by hand.

A step model whose decode step is exactly 8 ms whatever the batch (intercept only), so every
figure below is arithmetic on ``d`` (the overhead), the forecast's step wait and 8 ms.
"""

from __future__ import annotations

import pytest

from predictor import StepModel, StepParams, unknown_step_model
from predictor.overhead import added_overhead_s

STEP_S = 0.008
EIGHT_MS = StepModel(
    StepParams(
        base_s=STEP_S, per_token_s=0.0, per_decode_seq_s=0.0, per_compute_token_s=0.0, per_kv_token_s=0.0
    )
)


@pytest.mark.parametrize(
    ("overhead_s", "step_wait_s", "decodes", "expected_s"),
    [
        pytest.param(0.002, 0.0, 0.0, 0.002, id="idle-engine-all-of-it"),
        pytest.param(0.002, 0.004, 4.0, 0.0, id="busy-wait-covers-the-hop-and-its-spread"),
        # Late by 2 ms +- 1 ms (d - wait = 2 ms): always within the next step, one step of 8 ms.
        pytest.param(0.002, 0.0, 4.0, STEP_S, id="busy-late-by-less-than-a-step-one-step"),
        # Late by 0-2 ms (d - wait = 1 ms +- 1 ms): one step all along.
        pytest.param(0.002, 0.001, 4.0, STEP_S, id="busy-partly-late-one-step"),
        # Late by -1..+1 ms (d - wait = 0 +- 1 ms): in time half the time, one step otherwise.
        pytest.param(0.002, 0.002, 4.0, STEP_S / 2, id="busy-on-the-edge-half-a-step"),
        # A slow API server: late by 10-30 ms: 2 steps for 6 ms of it, 3 for 8 ms, 4 for 6 ms:
        # 3 steps on average.
        pytest.param(0.020, 0.0, 4.0, 3 * STEP_S, id="busy-hop-of-several-steps"),
    ],
)
def test_added_overhead(overhead_s: float, step_wait_s: float, decodes: float, expected_s: float) -> None:
    added = added_overhead_s(overhead_s, step_wait_s, decodes, decodes * 1000.0, EIGHT_MS)
    assert added == pytest.approx(expected_s)


def test_without_a_valid_step_model_all_of_it_is_added() -> None:
    assert added_overhead_s(0.002, 0.004, 4.0, 4000.0, unknown_step_model("no observations yet")) == 0.002
