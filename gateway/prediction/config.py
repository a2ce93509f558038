"""The ``prediction:`` section of the configuration: the measured forecast correction's knobs.

A strict ``Section`` (unknown keys rejected, frozen), mounted by ``gateway.config.settings.Settings``
like the other packages' sections, and hot-reloaded: ``gateway.prediction.live.follow_correction``
hands every new value to the ``PredictionService`` (what it learned is kept).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gateway.config.section import PositiveSeconds, Section
from predictor.correction import CorrectionConfig

__all__ = ["CorrectionSettings", "PredictionSettings"]


class CorrectionSettings(Section):
    """Each replica's forecasts corrected by what Sluice measured (docs/predictor.md, "Forecasts
    corrected by measurement")."""

    enabled: Annotated[
        bool,
        Field(
            description="Learn, per replica and load regime, measured over forecast TTFT and TPOT and "
            "multiply admission's forecasts by it. Off: the step model's forecasts alone."
        ),
    ] = True
    half_life_s: Annotated[
        PositiveSeconds,
        Field(
            description="Seconds after which a measurement weighs half as much: a change of the "
            "replica's speed is followed about one half-life later."
        ),
    ] = 15.0
    max_factor: Annotated[
        float,
        Field(
            ge=1.0,
            description="Largest factor a forecast is multiplied by (the smallest is 0.25); a "
            "measurement above it is not learned from, a TTFT below 0.25 is learned as 0.25.",
        ),
    ] = 10.0
    spread: Annotated[
        bool,
        Field(
            description="Judge each class's TTFT forecasts at its attainment_target quantile of what "
            "was measured in the request's load regime, not at the median: the correction also "
            "learns how far above the median that quantile lies. Off: the median alone (the "
            "attainment controller's margin is then all that covers the spread)."
        ),
    ] = True

    def config(self) -> CorrectionConfig:
        """The predictor's ``CorrectionConfig`` for these settings."""
        return CorrectionConfig(
            enabled=self.enabled, half_life_s=self.half_life_s, max_factor=self.max_factor, spread=self.spread
        )


class PredictionSettings(Section):
    """Latency prediction."""

    correction: Annotated[
        CorrectionSettings, Field(description="Forecasts corrected by measured latencies, per replica.")
    ] = CorrectionSettings()
