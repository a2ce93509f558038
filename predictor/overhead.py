"""What a replica's dispatch overhead adds to a forecast's TTFT (pure arithmetic, seconds).

``d`` is the caller's measured dispatch-to-token overhead beyond the engine's own clock. An idle
engine adds all of ``d``; a busy one adds nothing when the step wait is at least ``d``, else the
decode steps a request ``d - wait`` late waits for (averaged over its lateness). The reasoning is
in docs/predictor.md.
"""

from __future__ import annotations

import math

from predictor.step_model import StepBatch, StepModel

__all__ = ["added_overhead_s", "steps_waited_s"]


def added_overhead_s(
    overhead_s: float, step_wait_s: float, decode_seqs: float, kv_tokens: float, model: StepModel
) -> float:
    """Seconds the dispatch overhead ``overhead_s`` (> 0) adds to a forecast TTFT whose step wait
    is ``step_wait_s`` and whose prefill joins ``decode_seqs`` decoding sequences reading
    ``kv_tokens`` of KV (the forecast's prefill batch), on a replica stepping as ``model``."""
    if (step_wait_s > 0.0 or decode_seqs > 0.0) and model.valid:
        late = overhead_s - step_wait_s
        step = model.step_time(StepBatch(0.0, decode_seqs, kv_tokens))
        if step > 0.0:
            return steps_waited_s(late - 0.5 * overhead_s, late + 0.5 * overhead_s, step)
    return overhead_s


def steps_waited_s(late_lo_s: float, late_hi_s: float, step_s: float) -> float:
    """Mean seconds of engine steps (``step_s`` each, > 0) a request waits for when it reaches
    the engine uniformly between ``late_lo_s`` and ``late_hi_s`` seconds after the step in
    progress ended (<= 0: in time for it, none): ``ceil(late / step)`` steps each, averaged
    exactly. ``late_lo_s == late_hi_s``: that one lateness."""
    if late_hi_s <= late_lo_s:
        return math.ceil(late_hi_s / step_s) * step_s if late_hi_s > 0.0 else 0.0
    whole = _ceil_integral(late_hi_s, step_s) - _ceil_integral(late_lo_s, step_s)
    return step_s * whole / (late_hi_s - late_lo_s)


def _ceil_integral(x: float, step_s: float) -> float:
    """The integral of ``ceil(t / step_s) dt`` from 0 to ``x`` (0 for ``x <= 0``)."""
    if x <= 0.0:
        return 0.0
    whole = math.floor(x / step_s)
    return step_s * whole * (whole + 1) / 2.0 + (whole + 1) * (x - whole * step_s)
