"""The virtual-time replay: trace arrivals against emulated engines, on a virtual clock.

The second adapter over the admission and prediction code the gateway ships (the live gateway is
the first): one event loop (``replay.loop``) drives the emulator's engine and a gateway policy.
``replay.forecasts`` scores forecasts against the emulator's outcomes; ``replay.admission``
scores admission policies (``replay.policies``, ``replay.baselines``) by goodput. ``gateway``
never imports this package, and ``simulator`` (the ground truth) never imports it either.
"""

from replay.admission import GatewayReplayResult, run_gateway_replay
from replay.emulated import EmulatedReplica, make_replica, measure_capacity
from replay.forecasts import (
    DispatchObserver,
    ForecastingRouter,
    ReplayConfig,
    ReplayResult,
    RequestRecord,
    run_replay,
)
from replay.loop import Fleet, GatewayPolicy, ReplicaHandle, VirtualTimeLoop
from replay.requests import FleetConfig, GatewayRequest, Outcome, PromptText, Targets, gateway_requests
from replay.traces import (
    AZURE_CONV_TRACE,
    MOONCAKE_CONV_TRACE,
    TraceRequest,
    at_rate,
    fit_to_model_len,
    load_azure_trace,
    load_mooncake_trace,
    piecewise_rate,
)

__all__ = [
    "AZURE_CONV_TRACE",
    "MOONCAKE_CONV_TRACE",
    "DispatchObserver",
    "EmulatedReplica",
    "Fleet",
    "FleetConfig",
    "ForecastingRouter",
    "GatewayPolicy",
    "GatewayReplayResult",
    "GatewayRequest",
    "Outcome",
    "PromptText",
    "ReplayConfig",
    "ReplayResult",
    "ReplicaHandle",
    "RequestRecord",
    "Targets",
    "TraceRequest",
    "VirtualTimeLoop",
    "at_rate",
    "fit_to_model_len",
    "gateway_requests",
    "load_azure_trace",
    "load_mooncake_trace",
    "make_replica",
    "measure_capacity",
    "piecewise_rate",
    "run_gateway_replay",
    "run_replay",
]
