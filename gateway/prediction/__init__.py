"""Per-replica latency prediction: the predictor's step model, calibrated from each replica's scrapes.

Pure and synchronous like ``predictor/`` (no aiohttp, redis or prometheus_client, no I/O, no
clock reads): the live gateway and the virtual-time replay (the ``replay`` package) drive the same
``PredictionService`` with their own clocks. ``live`` (not imported here) is the live gateway's
adapter: it keeps the scraper and the service in step with the fleet and does the I/O.
"""

from gateway.prediction.facts import ReplicaFacts
from gateway.prediction.service import PredictionService
from gateway.prediction.service_config import PredictionConfig

__all__ = ["PredictionConfig", "PredictionService", "ReplicaFacts"]
