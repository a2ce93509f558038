"""The live gateway's predictions: scraping and the prediction service kept in step with the fleet.

What it does:

* keeps one ``MetricsScraper`` target and one ``PredictionService`` replica per registry entry,
  added and removed as reloads change the fleet (``sync``), with each replica's facts from its
  ``hardware:`` settings plus ``max_model_len`` from its ``/v1/models`` (``facts_of``);
* ``Admitted``: what the proxy keeps of a dispatched request (its ``LiveRequest``, admission's
  forecast with the dispatch overhead, the ``x-sluice-*`` headers that carry it);
* what a finished request teaches the service is handed over by the admission engine
  (``AdmissionEngine.finish``, driven by ``gateway.admission.live``);
* ``describe`` is the body of the admin endpoint ``GET /sluice/v1/replicas``;
* ``follow_correction`` keeps the service's forecast correction on the ``prediction.correction``
  settings across reloads.

Nothing here does I/O on the request path: a forecast reads only what the scraper's tasks already
delivered, so a slow, failing or stale scrape never delays or fails a request. A service that
raises is logged and the request goes on with ``x-sluice-prediction: internal_error``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.prediction.facts import ReplicaFacts
from gateway.prediction.service import PredictionService
from gateway.replicas.registry import LiveRequest, Replica, ReplicaRegistry
from gateway.replicas.scraper import MetricsScraper
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from predictor import Forecast

__all__ = [
    "PREDICTED_CACHED_HEADER",
    "PREDICTED_TPOT_HEADER",
    "PREDICTED_TTFT_HEADER",
    "PREDICTION_HEADER",
    "PREDICTION_HEADERS",
    "REPLICA_HEADER",
    "Admitted",
    "LivePredictions",
    "add_prediction_headers",
    "facts_of",
    "follow_correction",
    "forecast_headers",
]

log = logging.getLogger("sluice.predictions")

REPLICA_HEADER = "x-sluice-replica"
#: Engine TTFT forecast in milliseconds, one decimal; absent when the forecast has no number.
PREDICTED_TTFT_HEADER = "x-sluice-predicted-ttft-ms"
#: Mean TPOT forecast in milliseconds, two decimals; absent when the forecast has no number.
PREDICTED_TPOT_HEADER = "x-sluice-predicted-tpot-ms"
#: Prompt tokens the forecast took as hits in the replica's prefix cache; absent when none.
PREDICTED_CACHED_HEADER = "x-sluice-predicted-cached-tokens"
#: ``ok``, or the ``predictor.ForecastReason`` value that qualifies (or voids) the numbers.
PREDICTION_HEADER = "x-sluice-prediction"
#: The value of ``PREDICTION_HEADER`` when the prediction service itself failed.
INTERNAL_ERROR = "internal_error"

#: The headers ``add_prediction_headers`` puts on the request's response, set by the proxy.
PREDICTION_HEADERS: web.RequestKey[dict[str, str]] = web.RequestKey("sluice_prediction_headers")


@dataclass(frozen=True, slots=True)
class Admitted:
    """One request as ``LivePredictions.admit`` left it: its in-flight entry, the forecast made
    for it (``None`` when the service failed) and the response headers that carry it."""

    live: LiveRequest
    forecast: Forecast | None
    headers: dict[str, str]


def facts_of(replica: Replica) -> ReplicaFacts:
    """The predictor's facts for ``replica``: its ``hardware:`` settings (unset keys take
    ``ReplicaFacts``' defaults) and the smallest ``max_model_len`` its ``/v1/models`` lists."""
    hardware = replica.settings.hardware
    optional: dict[str, Any] = {}
    if hardware.max_num_seqs is not None:
        optional["max_num_seqs"] = hardware.max_num_seqs
    if hardware.max_num_batched_tokens is not None:
        optional["max_num_batched_tokens"] = hardware.max_num_batched_tokens
    return ReplicaFacts(
        gpu=hardware.canonical_gpu(),
        model=hardware.model,
        tensor_parallel=hardware.tensor_parallel,
        max_model_len=replica.max_model_len(),
        **optional,
    )


def ttft_header_value(ttft_s: float) -> str:
    """``x-sluice-predicted-ttft-ms``'s value for a finite TTFT of ``ttft_s`` seconds."""
    return f"{ttft_s * 1000:.1f}"


def forecast_headers(replica: str, forecast: Forecast | None) -> dict[str, str]:
    """The ``x-sluice-*`` headers for a request sent to ``replica`` with ``forecast``.

    ``None`` (the service failed) gives ``x-sluice-prediction: internal_error`` and no numbers.
    Numbers are present whenever they are finite: a ``stale_state`` forecast still has them,
    qualified by ``x-sluice-prediction: stale_state``; every other invalid reason has none.
    """
    headers = {REPLICA_HEADER: replica}
    if forecast is None:
        headers[PREDICTION_HEADER] = INTERNAL_ERROR
        return headers
    headers[PREDICTION_HEADER] = "ok" if forecast.valid else str(forecast.reason or "invalid")
    if math.isfinite(forecast.ttft_s):
        headers[PREDICTED_TTFT_HEADER] = ttft_header_value(forecast.ttft_s)
    if math.isfinite(forecast.tpot_s):
        headers[PREDICTED_TPOT_HEADER] = f"{forecast.tpot_s * 1000:.2f}"
    if forecast.cached_prompt_tokens > 0:
        headers[PREDICTED_CACHED_HEADER] = str(forecast.cached_prompt_tokens)
    return headers


async def add_prediction_headers(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: the forecast headers on every response to a proxied request,
    streaming or not, relayed replica errors and the gateway's own 502 included."""
    headers = request.get(PREDICTION_HEADERS)
    if headers:
        response.headers.update(headers)


def follow_correction(service: PredictionService, store: SettingsStore) -> None:
    """Give ``service`` the ``prediction.correction`` settings now and on every reload."""

    def apply(settings: Settings) -> None:
        service.configure_correction(settings.prediction.correction.config())

    apply(store.current)
    store.subscribe(lambda _old, new: apply(new))


class LivePredictions:
    """The scraper and the prediction service, following the registry; one per application.

    ``clock``: monotonic seconds, the same clock as the scraper's snapshots and the proxy's
    ``LiveRequest.started_at``.
    """

    def __init__(
        self,
        registry: ReplicaRegistry,
        scraper: MetricsScraper,
        service: PredictionService,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.scraper = scraper
        self.service = service
        self._clock = clock
        #: The replica object each scraper target reads its in-flight requests from.
        self._scraped: dict[str, Replica] = {}
        self._closed = False
        #: Other gateways' in-flight requests on a replica (``gateway.ledger``), counted in each
        #: scrape's ``in_flight`` like the gateway's own; ``None``: none.
        self.remote_in_flight: Callable[[str], Sequence[InFlight]] | None = None

    # -- the fleet ----------------------------------------------------------------------------------

    def sync(self) -> None:
        """Match scraper targets and service replicas to the registry's configured replicas.

        A replica object that changed (new URL, backend) gets a fresh scrape target; facts are set
        again for every replica (the service keeps its fit when they did not change).
        """
        if self._closed:
            return
        wanted = {replica.name: replica for replica in self.registry.replicas()}
        for name in [n for n in self._scraped if n not in wanted]:
            self.scraper.remove_replica(name)
            self.service.remove_replica(name)
            del self._scraped[name]
        for name, replica in wanted.items():
            if self._scraped.get(name) is not replica:
                self.scraper.add_replica(
                    name,
                    replica.base_url,
                    dialect=replica.settings.backend,
                    in_flight=self._in_flight_of(replica),
                    on_engine=_engine_setter(replica),
                )
                self._scraped[name] = replica
            self._set_facts(replica)

    def _in_flight_of(self, replica: Replica) -> Callable[[], tuple[InFlight, ...]]:
        """``replica``'s in-flight requests at a scrape: the gateway's, then the other gateways'."""

        def in_flight() -> tuple[InFlight, ...]:
            remote = self.remote_in_flight
            own = replica.in_flight()
            return own if remote is None else own + tuple(remote(replica.name))

        return in_flight

    def on_models(self, replica: Replica) -> None:
        """A replica's model list changed: its ``max_model_len`` may have."""
        if not self._closed and self._scraped.get(replica.name) is replica:
            self._set_facts(replica)

    def close(self) -> None:
        """Stop following the registry (its listeners cannot be removed)."""
        self._closed = True

    def _set_facts(self, replica: Replica) -> None:
        try:
            self.service.set_replica(replica.name, facts_of(replica))
        except Exception:
            log.exception("prediction service refused the facts of replica %s", replica.name)

    # -- the admin view -------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """JSON-ready: every replica (state, requests, last snapshot) and the service's fits and
        forecast corrections (``prediction.replicas.<name>.correction``)."""
        now = self._clock()
        replicas = []
        for entry in self.registry.describe():
            snapshot = self.scraper.latest(entry["name"])
            replicas.append({**entry, "metrics": snapshot_summary(snapshot, now)})
        try:
            prediction: Mapping[str, object] = self.service.describe(now)
        except Exception as exc:
            log.exception("prediction service describe() failed")
            prediction = {"error": f"{exc.__class__.__name__}: {exc}"}
        return {"replicas": replicas, "prediction": dict(prediction)}


def snapshot_summary(snapshot: ReplicaSnapshot | None, now: float) -> dict[str, Any] | None:
    """The admin view of one snapshot: freshness, ages in seconds, the main gauges and latencies.

    ``None`` before the replica's first scrape ended.
    """
    if snapshot is None:
        return None
    metrics_age = snapshot.metrics_age_s(now)
    return {
        "stale": snapshot.stale,
        "stale_reason": snapshot.stale_reason,
        "age_s": round(now - snapshot.taken_at, 3),
        "metrics_age_s": None if metrics_age is None else round(metrics_age, 3),
        "window_s": round(snapshot.window_s, 3),
        "dialect": snapshot.dialect,
        "num_running": snapshot.num_running,
        "num_waiting": snapshot.num_waiting,
        "kv_cache_usage": snapshot.kv_cache_usage,
        "kv_capacity_tokens": snapshot.kv_capacity_tokens,
        "block_size": snapshot.block_size,
        "steps_per_s": snapshot.steps_per_s,
        "generation_tokens_per_s": snapshot.generation_tokens_per_s,
        "itl_mean_s": snapshot.itl_mean_s,
        "ttft_mean_s": snapshot.ttft_mean_s,
        "gateway_in_flight": snapshot.gateway_in_flight,
    }


def _engine_setter(replica: Replica) -> Callable[[str], None]:
    """``on_engine`` for a ``backend: auto`` replica: what the scraper detected becomes
    ``replica.detected_engine``, so engine-bound routes (TGI's native API) can reach it."""

    def detected(engine: str) -> None:
        replica.detected_engine = engine

    return detected
