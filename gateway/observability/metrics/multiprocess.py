"""One ``/metrics`` for a host's workers (``server.workers`` > 1): prometheus_client's multiprocess
mode for the declared metrics, and per-worker snapshots for the collectors read at scrape time.

The supervisor gives every worker ``PROMETHEUS_MULTIPROC_DIR`` (``MULTIPROC_ENV``) before it
starts, so each ``Counter``, ``Histogram`` and ``Gauge`` writes its values to memory-mapped files
there and ``MultiProcessCollector`` adds them up whichever worker answers: counters and histograms
summed over every worker that ever ran (a restarted worker's counts stay), gauges as their
``multiprocess_mode`` says. The collectors that read live objects at scrape time (replica state,
queue, fits, the limiter, the process) have no files: each worker writes what they yield to
``live_<worker>.json`` in the same directory every ``SNAPSHOT_INTERVAL_S`` (and at once when it
answers a scrape), and ``LiveSnapshots`` merges the files: counters summed, the gauges in
``SUMMED_GAUGES`` summed, every other gauge kept per worker under a ``worker`` label (the
worker's index, 0 to N-1, stable across restarts).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

__all__ = [
    "MULTIPROC_ENV",
    "SNAPSHOT_INTERVAL_S",
    "SUMMED_GAUGES",
    "LiveSnapshots",
    "clear_directory",
    "exposition_registry",
    "multiprocess_directory",
    "scrape_time_collectors",
    "worker_gone",
]

log = logging.getLogger("sluice.metrics")

#: The variable prometheus_client reads at import to keep values in files (multiprocess mode).
MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
#: Seconds between two snapshots of a worker's scrape-time collectors.
SNAPSHOT_INTERVAL_S: Final = 1.0
#: Scrape-time gauges that are each worker's share of a host total, summed across workers; every
#: other scrape-time gauge is a worker's own view (its health checks, fits, margins), labelled.
SUMMED_GAUGES: Final = frozenset({"sluice_replica_in_flight_requests", "sluice_queue_length"})
_SNAPSHOT_PREFIX: Final = "live_"


def multiprocess_directory() -> Path | None:
    """The directory of multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``); ``None`` when unset."""
    text = os.environ.get(MULTIPROC_ENV, "").strip()
    return Path(text) if text else None


def clear_directory(directory: Path) -> None:
    """Remove what an earlier run left in ``directory`` (its ``*.db`` and snapshot files): the
    supervisor calls it before starting the workers, as prometheus_client asks."""
    for path in [*directory.glob("*.db"), *directory.glob(f"{_SNAPSHOT_PREFIX}*.json")]:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def worker_gone(directory: Path, pid: int, worker: int) -> None:
    """Forget worker ``worker`` (process ``pid``) that exited: its ``live*`` gauges drop out and
    its scrape-time snapshot is removed (its counters stay in the sums)."""
    mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]
    with contextlib.suppress(FileNotFoundError):
        (directory / f"{_SNAPSHOT_PREFIX}{worker}.json").unlink()


def _family_json(metric: Metric) -> dict[str, object]:
    return {
        "name": metric.name,
        "documentation": metric.documentation,
        "type": metric.type,
        "unit": metric.unit,
        "samples": [[s.name, s.labels, s.value] for s in metric.samples if math.isfinite(s.value)],
    }


def scrape_time_collectors(registry: CollectorRegistry) -> list[Collector]:
    """The collectors of ``registry`` that keep no values in the multiprocess files (everything
    but its ``Counter``, ``Gauge``, ``Histogram``, ...), in registration order: those that read
    live objects at scrape time, and those (the tenant levels) that set gauges when collected."""
    # prometheus_client lists a registry's collectors nowhere public.
    return [c for c in list(registry._collector_to_names) if not isinstance(c, MetricWrapperBase)]


class LiveSnapshots(Collector):
    """Writes this worker's scrape-time collectors of ``registry`` (``scrape_time_collectors``) to
    its snapshot file (``write``) and yields every worker's, merged, when collected (this worker's
    written fresh first)."""

    def __init__(self, directory: Path, worker: int, registry: CollectorRegistry) -> None:
        self.directory = directory
        self.worker = worker
        self._registry = registry
        self._path = directory / f"{_SNAPSHOT_PREFIX}{worker}.json"

    def write(self) -> None:
        """Collect this worker's scrape-time collectors and replace its snapshot file atomically."""
        collectors = scrape_time_collectors(self._registry)
        families = [_family_json(m) for c in collectors for m in c.collect()]
        tmp = self._path.with_name(f".{self._path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(families), encoding="utf-8")
        os.replace(tmp, self._path)

    def _read_all(self) -> Iterator[tuple[str, list[dict[str, object]]]]:
        for path in sorted(self.directory.glob(f"{_SNAPSHOT_PREFIX}*.json")):
            worker = path.stem.removeprefix(_SNAPSHOT_PREFIX)
            try:
                yield worker, json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # removed meanwhile (a worker gone), or never mind one scrape

    def collect(self) -> Iterable[Metric]:
        try:
            self.write()
        except OSError:
            log.exception("could not write this worker's metrics snapshot")
        return merge_snapshots(self._read_all())


def merge_snapshots(snapshots: Iterable[tuple[str, list[dict[str, object]]]]) -> list[Metric]:
    """The families of every worker's snapshot as one exposition: counters, histograms and the
    ``SUMMED_GAUGES`` summed by sample name and labels (``_created`` samples dropped); every other
    family's samples labelled ``worker``. Family order: first seen."""
    merged: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for worker, families in snapshots:
        for family in families:
            name, kind = str(family["name"]), str(family["type"])
            metric = merged.get(name)
            if metric is None:
                metric = merged[name] = Metric(name, str(family["documentation"]), kind, str(family["unit"]))
                sums[name] = {}
            summed = kind in ("counter", "histogram", "summary") or name in SUMMED_GAUGES
            samples = family["samples"]
            assert isinstance(samples, list)
            for sample_name, labels, value in samples:
                if summed:
                    if sample_name.endswith("_created"):
                        continue
                    key = (sample_name, tuple(sorted(labels.items())))
                    sums[name][key] = sums[name].get(key, 0.0) + float(value)
                else:
                    metric.samples.append(Sample(sample_name, {**labels, "worker": worker}, float(value)))
    for name, totals in sums.items():
        merged[name].samples.extend(Sample(s, dict(labels), v) for (s, labels), v in totals.items())
    return list(merged.values())


def exposition_registry(live: LiveSnapshots) -> CollectorRegistry:
    """The registry ``/metrics`` serves in a worker: every worker's declared metrics from the
    multiprocess files, then the merged scrape-time snapshots."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(live.directory))  # type: ignore[no-untyped-call]
    registry.register(live)
    return registry
