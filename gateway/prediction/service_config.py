"""``PredictionConfig``: the knobs of ``PredictionService`` and of the modules it delegates to.

Frozen and validated on construction (``ValueError`` on a knob out of range). Times are seconds,
weights fractions in the ranges each field states; the predictor's own configs are nested as
they are. No behaviour here: ``service``, ``scrape_learning``, ``finish_learning`` and
``forecasting`` read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from predictor import CalibrationConfig, Efficiency, ForecastConfig, OutputLengthConfig, PromptTokenConfig
from predictor.correction import CorrectionConfig

__all__ = ["PredictionConfig"]


@dataclass(frozen=True, slots=True)
class PredictionConfig:
    """Knobs of the service (the predictor's own configs are nested as they are).

    ``refit_interval_s``: least seconds between two fits of one replica (0 = on every snapshot).
    ``stale_after_s``: a forecast built on metrics older than this is flagged ``stale_state``.
    ``efficiency``: the roofline prior's efficiency guesses.
    ``prefill_share_memory_s``: seconds of windows the long-run prefill share is averaged over.
    ``prefill_share_weight``: weight (0-1) of the newest window's share against that mean.
    ``learn_dispatch_overhead``: learn each replica's dispatch overhead (the caller's TTFT minus
    the replica's own, see ``scrape_learning.observe_overhead``) and add it to forecast TTFTs.
    Off by default: the virtual-time replay has no transport, and window-edge noise there would
    teach it a spurious overhead. The live gateway should turn it on.
    ``overhead_samples``: most caller-measured TTFTs kept per replica for the dispatch overhead.
    ``overhead_weight``: EWMA weight (0-1] of each scrape window's overhead measurement.
    ``overhead_min_window_s`` / ``overhead_min_requests``: a scrape window shorter than this
    (seconds), or holding fewer of the caller's finished requests, does not measure it (window
    edges count a request's decode time against it).
    ``api_residual_weight``: EWMA weight (0-1] of each finished request in its API's TTFT residual
    (``PredictionService.api_residual_s``, a diagnostic: forecasts do not use it);
    ``api_residual_min_requests``: finished requests of an API on a replica before it is reported.
    ``steady_state``: blend each TPOT forecast toward the replica's steady state under its recent
    traffic (``predictor.steady.steady_state``: Little's law over the requests the caller saw
    finish there in the last ``arrival_memory_s`` seconds); off: the batch it joins alone. Off by
    default: recent traffic predicts the next seconds' worse than the batch does (measured in
    docs/predictor-accuracy.md).
    ``arrival_min_span_s``: seconds of that history needed before a rate is trusted.
    ``capacity_memory_s``: seconds a replica's full-engine finish rate (its capacity: requests it
    finished per second in the scrape intervals it had requests waiting throughout) is
    remembered; ``capacity_window_s``: seconds of the newest such intervals it is measured over;
    ``capacity_min_s``: seconds of them needed before it is used. A full engine frees a slot per
    finished request; the rate of the last window is that only if the engine was full through
    it (after a quiet spell it is the quiet traffic's), so a newcomer's wait for a slot counts
    the larger of the two.
    ``correction``: the measured correction of each replica's TTFT and TPOT forecasts
    (``predictor.correction``: learned in ``on_finished``, read with ``correction``).
    """

    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    output_length: OutputLengthConfig = field(default_factory=OutputLengthConfig)
    prompt_tokens: PromptTokenConfig = field(default_factory=PromptTokenConfig)
    efficiency: Efficiency = field(default_factory=Efficiency)
    refit_interval_s: float = 0.0
    stale_after_s: float = 5.0
    prefill_share_memory_s: float = 60.0
    prefill_share_weight: float = 0.3
    learn_dispatch_overhead: bool = False
    overhead_samples: int = 512
    overhead_weight: float = 0.2
    overhead_min_window_s: float = 5.0
    overhead_min_requests: int = 10
    api_residual_weight: float = 0.05
    api_residual_min_requests: int = 20
    steady_state: bool = False
    arrival_memory_s: float = 60.0
    arrival_min_span_s: float = 10.0
    capacity_memory_s: float = 300.0
    capacity_window_s: float = 30.0
    capacity_min_s: float = 5.0
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)

    def __post_init__(self) -> None:
        if self.refit_interval_s < 0 or self.stale_after_s <= 0 or self.prefill_share_memory_s <= 0:
            raise ValueError("refit_interval_s must be >= 0, stale_after_s and prefill_share_memory_s > 0")
        if not 0.0 <= self.prefill_share_weight <= 1.0:
            raise ValueError(f"prefill_share_weight must be in [0, 1], got {self.prefill_share_weight}")
        if self.overhead_samples < 1 or not 0.0 < self.overhead_weight <= 1.0:
            raise ValueError("overhead_samples must be >= 1 and overhead_weight in (0, 1]")
        if not 0.0 < self.api_residual_weight <= 1.0 or self.api_residual_min_requests < 1:
            raise ValueError("api_residual_weight must be in (0, 1] and api_residual_min_requests >= 1")
        if not 0.0 < self.arrival_min_span_s <= self.arrival_memory_s:
            raise ValueError("need 0 < arrival_min_span_s <= arrival_memory_s")
        if not 0.0 < self.capacity_min_s <= self.capacity_window_s <= self.capacity_memory_s:
            raise ValueError("need 0 < capacity_min_s <= capacity_window_s <= capacity_memory_s")
