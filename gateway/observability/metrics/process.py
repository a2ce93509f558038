"""The process itself: the build it runs, its configuration reloads, and prometheus_client's
process, platform and garbage-collector collectors.

``register_build_info`` and ``register_runtime`` are called by ``SluiceMetrics`` first and last
(the exposition lists the build first and the runtime series after Sluice's own).
``ReloadMetrics`` starts as "last reload successful, now": start-up counts as a load.
"""

from __future__ import annotations

from importlib import metadata

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.registry import Collector


def register_build_info(registry: CollectorRegistry) -> Gauge:
    """``sluice_build_info{version}``, always 1, registered in ``registry``."""
    build_info = Gauge(
        "sluice_build_info",
        "Always 1; the running version.",
        ["version"],
        registry=registry,
        multiprocess_mode="max",
    )
    build_info.labels(_version()).set(1)
    return build_info


def register_runtime(registry: CollectorRegistry) -> list[Collector]:
    """prometheus_client's process, platform and GC collectors, registered in ``registry``; returns them."""
    return [
        ProcessCollector(registry=registry),
        PlatformCollector(registry=registry),
        # python_gc_collections_total and python_gc_objects_collected_total, by generation: the
        # cycle collector's work (its pauses stop the event loop; see gateway.serve._quiet_gc).
        GCCollector(registry=registry),
    ]


def register_worker_requests(registry: CollectorRegistry) -> Counter:
    """``sluice_worker_requests_total{worker}``, registered in ``registry``; counted only by the
    workers of ``server.workers`` > 1."""
    return Counter(
        "sluice_worker_requests_total",
        "Requests each worker process (server.workers > 1) finished, by worker index: how the "
        "kernel spread the port's connections. No samples with one process.",
        ["worker"],
        registry=registry,
    )


def _version() -> str:
    try:
        return metadata.version("sluice")
    except metadata.PackageNotFoundError:
        return "unknown"


class ReloadMetrics:
    """Configuration reload series, registered in ``registry`` at construction."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.reloads = Counter(
            "sluice_config_reloads_total", "Configuration reload attempts, by result.", ["result"], registry=r
        )
        self.reload_ok = Gauge(
            "sluice_config_last_reload_successful",
            "1 when the last configuration reload succeeded (or none failed since start), else 0; "
            "with several workers, the lowest of theirs.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.reload_ok.set(1)
        self.reload_success_time = Gauge(
            "sluice_config_last_reload_success_timestamp_seconds",
            "Unix time of the last successful configuration load (start-up counts); with several "
            "workers, the oldest of theirs.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.reload_success_time.set_to_current_time()

    def observe_reload(self, ok: bool) -> None:
        """One reload attempt: ``ok`` True when the file was valid (applied or unchanged)."""
        self.reloads.labels("success" if ok else "failure").inc()
        self.reload_ok.set(1 if ok else 0)
        if ok:
            self.reload_success_time.set_to_current_time()
