"""Sluice's predictor: pure, synchronous step-time model, calibration and latency forecasts.

No I/O, no clock reads (times come in as arguments), and no imports of ``gateway``, ``simulator``,
aiohttp, redis or prometheus_client: the live gateway and the virtual-clock replay drive the same
objects. It sees only what a real engine exposes plus facts an operator configures.
"""

from predictor.calibrate import Calibration, CalibrationConfig, FitReport, StepCalibrator
from predictor.forecast import Forecast, ForecastConfig, forecast_request, prefill_share
from predictor.forecast_inputs import CandidateRequest, ForecastReason, ReplicaState, RunningSeq
from predictor.hardware import GPUS, UNKNOWN_GPU, GpuSpec, gpu_names, lookup_gpu
from predictor.model import MODELS, ModelArch, llama_style, lookup_model, model_names
from predictor.observations import (
    Observation,
    ObservationSource,
    Reject,
    WindowStats,
    observation_from_window,
)
from predictor.output_length import (
    OutputLengthConfig,
    OutputLengthEstimate,
    OutputLengthPredictor,
    Population,
)
from predictor.prompt_tokens import PromptTokenConfig, PromptTokenEstimate, PromptTokenEstimator
from predictor.step_model import (
    FEATURE_NAMES,
    IDEAL,
    Efficiency,
    ModelSource,
    RooflineTerms,
    StepBatch,
    StepModel,
    StepParams,
    roofline_prior,
    roofline_terms,
    unknown_step_model,
)

__all__ = [
    "FEATURE_NAMES",
    "GPUS",
    "IDEAL",
    "MODELS",
    "UNKNOWN_GPU",
    "Calibration",
    "CalibrationConfig",
    "CandidateRequest",
    "Efficiency",
    "FitReport",
    "Forecast",
    "ForecastConfig",
    "ForecastReason",
    "GpuSpec",
    "ModelArch",
    "ModelSource",
    "Observation",
    "ObservationSource",
    "OutputLengthConfig",
    "OutputLengthEstimate",
    "OutputLengthPredictor",
    "Population",
    "PromptTokenConfig",
    "PromptTokenEstimate",
    "PromptTokenEstimator",
    "Reject",
    "ReplicaState",
    "RooflineTerms",
    "RunningSeq",
    "StepBatch",
    "StepCalibrator",
    "StepModel",
    "StepParams",
    "WindowStats",
    "forecast_request",
    "gpu_names",
    "llama_style",
    "lookup_gpu",
    "lookup_model",
    "model_names",
    "observation_from_window",
    "prefill_share",
    "roofline_prior",
    "roofline_terms",
    "unknown_step_model",
]
