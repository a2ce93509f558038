"""The host's ``/metrics`` with several workers (``server.workers`` > 1): every worker's counters
and histograms summed, gauges as their ``multiprocess_mode`` says, and the scrape-time collectors'
snapshots merged (``gateway.observability.metrics.multiprocess``).

prometheus_client picks its file-backed values when it is imported, so each "worker" here is a
real process started with ``PROMETHEUS_MULTIPROC_DIR`` and ``SLUICE_WORKER`` set, as the
supervisor starts them; the last one prints the exposition it would serve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.observability.metrics.multiprocess import merge_snapshots

ROOT = Path(__file__).resolve().parents[2]

#: One worker: ``sys.argv[1]`` requests of 0.25 s each, its snapshot written, the exposition
#: printed when ``sys.argv[2]`` is "print".
WORKER = """
import sys
from gateway.observability.metrics import SluiceMetrics
from gateway.observability.outcome import RequestOutcome

metrics = SluiceMetrics()
metrics.set_known_labels(classes=["interactive"])
metrics.track_queue(lambda: {"interactive": 2})
for i in range(int(sys.argv[1])):
    metrics.observe_outcome(
        RequestOutcome(f"r{i}", "POST", "/v1/completions", received_at=5.0, replica="emu-0", status=200,
                       dispatched_at=5.0, finished_at=5.25)
    )
assert metrics.live is not None
metrics.live.write()
if sys.argv[2] == "print":
    sys.stdout.write(metrics.exposition()[0].decode())
"""


def _run_worker(directory: Path, worker: int, requests: int, *, show: bool = False) -> str:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory), "SLUICE_WORKER": str(worker)}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(requests), "print" if show else "-"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _samples(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples: list[Sample], name: str, **labels: str) -> float | None:
    found = [
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def test_counters_and_histograms_sum_across_worker_processes(tmp_path: Path) -> None:
    _run_worker(tmp_path, 0, 3)
    _run_worker(tmp_path, 1, 5)
    samples = _samples(_run_worker(tmp_path, 2, 0, show=True))

    requests = [s for s in samples if s.name == "sluice_requests_total"]
    assert sum(s.value for s in requests) == 8
    assert _value(samples, "sluice_request_duration_seconds_count") == 8
    assert _value(samples, "sluice_request_duration_seconds_sum") == 8 * 0.25
    assert _value(samples, "sluice_request_duration_seconds_bucket", le="0.1") == 0
    assert _value(samples, "sluice_request_duration_seconds_bucket", le="+Inf") == 8
    # Who answered how many: the kernel's split of the port's connections.
    assert _value(samples, "sluice_worker_requests_total", worker="0") == 3
    assert _value(samples, "sluice_worker_requests_total", worker="1") == 5
    assert _value(samples, "sluice_worker_requests_total", worker="2") == 0  # up, answered none
    # A constant gauge is not multiplied by the workers; the reload state is the worst worker's.
    assert [s.value for s in samples if s.name == "sluice_build_info"] == [1.0]
    assert _value(samples, "sluice_config_last_reload_successful") == 1
    # Scrape-time: each worker's queue is a share of the host's, summed; no pid label anywhere.
    assert _value(samples, "sluice_queue_length", **{"class": "interactive"}) == 3 * 2
    assert not [s for s in samples if "pid" in s.labels]
    # A process's own resident memory stays per worker.
    assert {s.labels["worker"] for s in samples if s.name == "process_resident_memory_bytes"} == {
        "0",
        "1",
        "2",
    }


def test_merge_sums_counters_and_listed_gauges_and_labels_the_rest() -> None:
    def snapshot(queue: float, healthy: float, done: float) -> list[dict[str, object]]:
        return [
            {"name": "sluice_queue_length", "documentation": "q", "type": "gauge", "unit": "",
             "samples": [["sluice_queue_length", {"class": "batch"}, queue]]},
            {"name": "sluice_replica_healthy", "documentation": "h", "type": "gauge", "unit": "",
             "samples": [["sluice_replica_healthy", {"replica": "r0"}, healthy]]},
            {"name": "sluice_fits", "documentation": "f", "type": "counter", "unit": "",
             "samples": [["sluice_fits_total", {"replica": "r0"}, done], ["sluice_fits_created", {}, 1.0]]},
        ]  # fmt: skip

    merged = {
        m.name: m.samples for m in merge_snapshots([("0", snapshot(1, 1, 4)), ("1", snapshot(2, 0, 6))])
    }
    assert merged["sluice_queue_length"] == [Sample("sluice_queue_length", {"class": "batch"}, 3.0)]
    assert merged["sluice_replica_healthy"] == [
        Sample("sluice_replica_healthy", {"replica": "r0", "worker": "0"}, 1.0),
        Sample("sluice_replica_healthy", {"replica": "r0", "worker": "1"}, 0.0),
    ]
    assert merged["sluice_fits"] == [Sample("sluice_fits_total", {"replica": "r0"}, 10.0)]


def test_every_declared_gauge_says_how_workers_combine() -> None:
    """A ``Gauge`` left at prometheus_client's default mode (``all``) would show one series per
    worker pid: each says how the host's value is made (sum, max, min, most recent)."""
    from prometheus_client import Gauge

    from gateway.observability.metrics import SluiceMetrics

    registry = SluiceMetrics().registry
    gauges = [c for c in list(registry._collector_to_names) if isinstance(c, Gauge)]
    assert gauges
    assert {g._name: g._multiprocess_mode for g in gauges if g._multiprocess_mode == "all"} == {}
