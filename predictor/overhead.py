"""What a replica's dispatch overhead adds to a forecast's TTFT (pure arithmetic, seconds).

The engine forecast (``predictor.forecast``) says when the engine makes a request's first token,
counted from the engine's own clock. The caller (a gateway) measures from its dispatch to the
token's arrival: the way in, the replica server's own work and the way back, ``d`` seconds in
all (learned per replica by the caller). How much of ``d`` a TTFT holds depends on the engine:

* **idle** (no step in progress, nothing decoding): the request's prefill starts when it gets
  there, so all of ``d`` comes on top;
* **busy**: the forecast's step wait runs to the end of the step in progress as the caller sees
  it, from tokens that took the way back too, and the request's prefill starts at that step's
  end if it gets there in time: when the wait is at least ``d`` nothing is added. Otherwise it is
  ``d - wait`` late and waits for the end of the step in progress when it gets there:
  ``ceil((d - wait) / step)`` decode steps of the batch it joins. Its lateness varies from request
  to request by about the hop itself: it is taken as uniform over ``(d - wait) +- d / 2`` and the
  steps averaged over that, so a request near the edge is forecast half a step late rather than a
  whole step wrong half the time.

``gateway.prediction.PredictionService.with_overhead`` adds this to the forecast a response
carries; admission adds the same to every TTFT it holds against a deadline.
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
