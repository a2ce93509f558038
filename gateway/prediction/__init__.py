"""Per-replica latency prediction: the predictor's step model, calibrated from each replica's scrapes.

Pure and synchronous like ``predictor/`` (no aiohttp, redis or prometheus_client, no I/O, no
clock reads): the live gateway and the virtual-time replay (the ``replay`` package) drive the same
``PredictionService`` with their own clocks.
"""

from gateway.prediction.facts import ReplicaFacts
from gateway.prediction.service import PredictionConfig, PredictionService

__all__ = ["PredictionConfig", "PredictionService", "ReplicaFacts"]
