"""Other gateways' requests are counted once: in the forecast's in-flight list like the gateway's
own, and in each scrape's ``in_flight``, so the scrape's count of requests beyond the gateway's
(other clients) leaves them out."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.ledger.state import Entry, RemoteLedger
from gateway.prediction.live import LivePredictions
from gateway.prediction.service import PredictionService
from gateway.prediction.state import Limits, Load, replica_state
from gateway.replicas.registry import LiveRequest, ReplicaRegistry
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from predictor import StepModel, StepParams

MODEL = StepModel(StepParams(0.010, 0.0, 0.0, 1e-5, 0.0, 0.0, knee_tokens=0.0))
LIMITS = Limits(kv_capacity_tokens=100_000, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
SCRAPE = ReplicaSnapshot(
    name="r0", taken_at=1.0, metrics_at=1.0, kv_cache_usage=0.01, kv_capacity_tokens=100_000
)
OFFSET = 1_000.0


def _rest(generated: Sequence[int], max_tokens: Sequence[int | None]) -> list[float]:
    return [50.0] * len(generated)


def _remote(n: int, gateway: str = "g2") -> tuple[InFlight, ...]:
    ledger = RemoteLedger("g1", max_entries_per_replica=100)
    for i in range(n):
        ledger.put(Entry(gateway, f"{gateway}/{i}", "r0", 100, 40.0, 64, None, 1_000.0, 1_000.5, 3, 1), 0.0)
    return ledger.in_flight("r0", OFFSET)


def _decodes(in_flight: Sequence[InFlight], engine_running: int, at_scrape: Sequence[InFlight]) -> int:
    snapshot = dataclasses.replace(
        SCRAPE, num_running=engine_running, num_waiting=0, in_flight=tuple(at_scrape)
    )
    state = replica_state(
        in_flight,
        snapshot,
        limits=LIMITS,
        load=Load(),
        remaining=_rest,
        stale=False,
        model=MODEL,
        now=1.2,
        last_boundary=None,
    )
    return state.decode_seqs


@pytest.mark.parametrize(
    ("remote_at_scrape", "expected"),
    [
        pytest.param(3, 5, id="scrape-shows-them-counted-once"),
        pytest.param(0, 5, id="dispatched-after-the-scrape-counted-once"),
    ],
)
def test_remote_requests_are_counted_once(remote_at_scrape: int, expected: int) -> None:
    ours = [InFlight(f"o{i}", 100, 3, 0.5, 64, first_token_at=0.6) for i in range(2)]
    theirs = list(_remote(3))
    # The engine ran what the scrape's in_flight listed, nothing else: no other clients.
    at_scrape = ours + theirs[:remote_at_scrape]
    assert _decodes(ours + theirs, len(at_scrape), at_scrape) == expected


def test_without_the_ledger_the_scrape_counts_them_as_other_clients() -> None:
    ours = [InFlight(f"o{i}", 100, 3, 0.5, 64, first_token_at=0.6) for i in range(2)]
    assert _decodes(ours, 5, ours) == 5  # 3 foreign decodes from the scrape


class _Scraper:
    """Records each target's in-flight source (``MetricsScraper.add_replica``)."""

    def __init__(self) -> None:
        self.sources: dict[str, Any] = {}

    def add_replica(self, name: str, base_url: str, *, dialect: str, in_flight: Any, on_engine: Any) -> None:
        self.sources[name] = in_flight

    def remove_replica(self, name: str) -> None:
        self.sources.pop(name, None)


def test_each_scrape_lists_the_other_gateways_requests_after_its_own() -> None:
    settings = Settings.model_validate({"replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}]})
    registry = ReplicaRegistry(SettingsStore(settings))
    scraper = _Scraper()
    predictions = LivePredictions(registry, scraper, PredictionService())  # type: ignore[arg-type]
    predictions.sync()
    replica = registry.get("r0")
    assert replica is not None
    live = LiveRequest("own", 50, 0.0)
    with registry.lease(replica, live):
        assert [f.request_id for f in scraper.sources["r0"]()] == ["own"]
        theirs = _remote(2)
        predictions.remote_in_flight = lambda name: theirs if name == "r0" else ()
        assert [f.request_id for f in scraper.sources["r0"]()] == ["own", "g2/0", "g2/1"]
