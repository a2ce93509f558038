"""Unit tests of ``gateway.observability.metrics``: label limits, per-request arithmetic, the
outcome listener, the scrape-time collector, naming rules, and ``install`` on a real app."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_app
from gateway.config.load import default_settings
from gateway.config.settings import ServerSettings, Settings
from gateway.config.store import SettingsStore
from gateway.keys import OUTCOME_LISTENERS
from gateway.limits.base import (
    BucketState,
    ConcurrencyState,
    LimiterStats,
    Reservation,
    TenantLimits,
)
from gateway.observability.metrics import METRICS, SluiceMetrics
from gateway.observability.metrics.endpoints import replica_targets
from gateway.observability.metrics.labels import code_label, configured_classes, configured_tenants, limited
from gateway.observability.metrics.outcomes import decision_of, proxy_overhead_s, relative_error, slo_result
from gateway.observability.outcome import RequestOutcome
from gateway.replicas.config import HealthSettings, ReplicaSettings
from gateway.replicas.registry import ReplicaRegistry
from gateway.replicas.snapshot import ReplicaSnapshot
from predictor import FitReport, ModelSource, StepParams


@dataclass(slots=True)
class AdmittedOutcome(RequestOutcome):
    """``RequestOutcome`` plus the fields the admission and prediction work add (see metrics.py)."""

    request_class: str | None = None
    tenant: str | None = None
    decision: str | None = None
    reason: str | None = None
    queue_wait_s: float | None = None
    retry_after_s: float | None = None
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None


def outcome(**fields: Any) -> AdmittedOutcome:
    """A streamed request on replica ``emu-0``: arrival 100 s, dispatch +10 ms, first token at
    +0.5 s, 11 tokens ending at +1.5 s (TPOT 0.1 s), targets TTFT 1 s / TPOT 0.15 s."""
    base: dict[str, Any] = {
        "request_id": "r",
        "method": "POST",
        "path": "/v1/chat/completions",
        "received_at": 100.0,
        "model": "m",
        "stream": True,
        "replica": "emu-0",
        "status": 200,
        "prompt_tokens": 20,
        "completion_tokens": 11,
        "dispatched_at": 100.01,
        "first_token_at": 100.5,
        "finished_at": 101.5,
        "ttft_target_s": 1.0,
        "tpot_target_s": 0.15,
    }
    base.update(fields)
    return AdmittedOutcome(**base)


def value(metrics: SluiceMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


# -- labels ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, "none"), ("interactive", "interactive"), ("Interactive", "other"), ("batch2", "other")],
    ids=["missing-is-none", "configured-kept", "case-matters", "unconfigured-is-other"],
)
def test_limited_keeps_only_configured_values(raw: str | None, expected: str) -> None:
    assert limited(raw, {"interactive", "batch"}) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, "none"),
        ("slo_unattainable", "slo_unattainable"),
        ("tokens", "tokens"),
        ("Bad Reason!", "other"),
        ("x" * 65, "other"),
        ("9lives", "other"),
    ],
    ids=["none", "snake-case", "short", "spaces-and-caps", "too-long", "leading-digit"],
)
def test_code_label_accepts_only_code_shaped_values(raw: str | None, expected: str) -> None:
    assert code_label(raw) == expected


def test_configured_names_are_read_from_the_sections_that_hold_them() -> None:
    today = Settings(replicas=[ReplicaSettings(name="a", url="http://127.0.0.1:1")])
    assert configured_classes(today) == {"interactive", "batch"}  # the admission defaults
    assert configured_tenants(today) == frozenset()
    with_tenants = default_settings()  # the embedded default configures the demo tenant
    assert configured_tenants(with_tenants) == set(with_tenants.tenants.tenants) == {"demo"}


def test_unconfigured_class_and_tenant_become_other_and_missing_ones_none() -> None:
    metrics = SluiceMetrics()
    metrics.set_known_labels(classes=["interactive"], tenants=["acme"])
    metrics.observe_outcome(outcome(request_class="interactive", tenant="acme"))
    metrics.observe_outcome(outcome(request_class="made-up", tenant="someone-else"))
    metrics.observe_outcome(outcome())
    common = {"decision": "admitted", "reason": "ok"}
    assert (
        value(metrics, "sluice_requests_total", **common, **{"class": "interactive", "tenant": "acme"}) == 1
    )
    assert value(metrics, "sluice_requests_total", **common, **{"class": "other", "tenant": "other"}) == 1
    assert value(metrics, "sluice_requests_total", **common, **{"class": "none", "tenant": "none"}) == 1


# -- per-request arithmetic ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, ("admitted", "ok")),
        ({"replica": None, "error": "no_healthy_replica", "status": 503}, ("rejected", "no_healthy_replica")),
        ({"replica": None}, ("rejected", "unknown")),
        (
            {"decision": "rejected", "reason": "slo_unattainable", "replica": None},
            ("rejected", "slo_unattainable"),
        ),
        ({"decision": "shadow_rejected", "reason": "overloaded"}, ("shadow_rejected", "overloaded")),
        ({"decision": "rejected", "reason": "Not A Code"}, ("rejected", "other")),
    ],
    ids=["routed", "no-replica-error", "no-replica-no-error", "admission", "shadow", "odd-reason"],
)
def test_decision_of(fields: dict[str, Any], expected: tuple[str, str]) -> None:
    assert decision_of(outcome(**fields)) == expected


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, "met"),
        ({"first_token_at": 101.2, "finished_at": 102.2}, "missed_ttft"),
        ({"finished_at": 102.5}, "missed_tpot"),
        ({"first_token_at": 101.2, "finished_at": 103.2}, "missed_both"),
        ({"first_token_at": None}, "missed_ttft"),
        ({"completion_tokens": 1, "finished_at": 100.5}, "met"),
        ({"stream": False, "first_token_at": None, "finished_at": 102.0}, "met"),
        ({"stream": False, "first_token_at": None, "finished_at": 103.0}, "missed_e2e"),
        ({"error": "upstream_error"}, "failed"),
        ({"status": 400, "error": "replica_rejected"}, "failed"),
        ({"error": "client_disconnected"}, "abandoned"),
        ({"ttft_target_s": None}, None),
        ({"replica": None, "decision": "rejected"}, None),
    ],
    ids=[
        "both-met",
        "ttft-late",
        "tpot-slow",
        "both-missed",
        "stream-without-token",
        "one-token-has-no-tpot",
        "non-stream-within-budget",
        "non-stream-over-budget",
        "upstream-error",
        "replica-4xx",
        "client-left",
        "no-targets-not-judged",
        "rejected-not-judged",
    ],
)
def test_slo_result(fields: dict[str, Any], expected: str | None) -> None:
    assert slo_result(outcome(**fields)) == expected


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, 0.01),
        ({"dispatched_at": 100.51, "queue_wait_s": 0.5}, 0.01),
        ({"dispatched_at": None}, None),
    ],
    ids=["no-queue", "queue-excluded", "never-dispatched"],
)
def test_proxy_overhead_excludes_queue_wait(fields: dict[str, Any], expected: float | None) -> None:
    got = proxy_overhead_s(outcome(**fields))
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    ("predicted", "observed", "expected"),
    [(1.2, 1.0, 0.2), (0.5, 1.0, -0.5), (1.0, 0.0, None)],
    ids=["pessimistic", "optimistic", "zero-observed"],
)
def test_relative_error(predicted: float, observed: float, expected: float | None) -> None:
    got = relative_error(predicted, observed)
    assert got == (None if expected is None else pytest.approx(expected))


# -- the outcome listener ------------------------------------------------------------------------------
def test_observe_outcome_records_latency_tokens_predictions_and_slo() -> None:
    metrics = SluiceMetrics()
    metrics.set_known_labels(classes=["interactive"])
    metrics.observe_outcome(
        outcome(
            request_class="interactive", predicted_ttft_s=0.49 * 1.3, predicted_tpot_s=0.08, queue_wait_s=0.0
        )
    )
    cls = {"class": "interactive"}
    assert value(metrics, "sluice_responses_total", status="200", **cls) == 1
    assert value(metrics, "sluice_prompt_tokens_total", tenant="none", **cls) == 20
    assert value(metrics, "sluice_completion_tokens_total", tenant="none", **cls) == 11
    assert value(metrics, "sluice_ttft_seconds_sum", **cls) == pytest.approx(0.5)
    assert value(metrics, "sluice_tpot_seconds_sum", **cls) == pytest.approx(0.1)
    assert value(metrics, "sluice_request_duration_seconds_sum", **cls) == pytest.approx(1.5)
    assert value(metrics, "sluice_queue_wait_seconds_count", decision="admitted", **cls) == 1
    assert value(metrics, "sluice_slo_requests_total", result="met", **cls) == 1
    assert value(metrics, "sluice_observed_ttft_seconds_sum", replica="emu-0") == pytest.approx(0.49)
    assert value(metrics, "sluice_predicted_ttft_seconds_sum", replica="emu-0") == pytest.approx(0.637)
    ttft, tpot = {"replica": "emu-0", "kind": "ttft"}, {"replica": "emu-0", "kind": "tpot"}
    assert value(metrics, "sluice_prediction_abs_error_ratio_sum", **ttft) == pytest.approx(0.3)
    assert value(metrics, "sluice_prediction_abs_error_ratio_sum", **tpot) == pytest.approx(0.2)
    # The signed histogram has negative buckets, so prometheus_client exports no _sum for it.
    signed = "sluice_prediction_error_ratio_bucket"
    assert value(metrics, signed, le="0.25", **ttft) == 0
    assert value(metrics, signed, le="0.35", **ttft) == 1  # +30 %: pessimistic
    assert value(metrics, signed, le="-0.25", **tpot) == 0
    assert value(metrics, signed, le="-0.15", **tpot) == 1  # -20 %: optimistic
    assert value(metrics, "sluice_proxy_overhead_seconds_sum") == pytest.approx(0.01)
    # No prefix-cache hit expected or reported: no sample, never a made-up zero.
    assert value(metrics, "sluice_prompt_cached_tokens_total", replica="emu-0", source="expected") is None


def test_observe_outcome_counts_the_prefix_cache_hits_expected_and_reported() -> None:
    metrics = SluiceMetrics()
    metrics.observe_outcome(outcome(expected_cached_tokens=12, cached_tokens=16))
    metrics.observe_outcome(outcome(expected_cached_tokens=0, cached_tokens=None))
    metrics.observe_outcome(outcome(expected_cached_tokens=4, cached_tokens=0))
    assert value(metrics, "sluice_prompt_cached_tokens_total", replica="emu-0", source="expected") == 16
    assert value(metrics, "sluice_prompt_cached_tokens_total", replica="emu-0", source="reported") == 16


def test_observe_outcome_of_a_rejection_counts_its_retry_after_and_no_latency() -> None:
    metrics = SluiceMetrics()
    rejected = outcome(
        replica=None,
        decision="rejected",
        reason="overloaded",
        status=429,
        retry_after_s=3.0,
        queue_wait_s=0.2,
        dispatched_at=None,
        first_token_at=None,
        prompt_tokens=None,
        completion_tokens=None,
    )
    metrics.observe_outcome(rejected)
    cls = {"class": "none"}
    assert (
        value(
            metrics, "sluice_requests_total", tenant="none", decision="rejected", reason="overloaded", **cls
        )
        == 1
    )
    assert value(metrics, "sluice_retry_after_seconds_sum", reason="overloaded", **cls) == 3.0
    assert value(metrics, "sluice_queue_wait_seconds_sum", decision="rejected", **cls) == pytest.approx(0.2)
    assert value(metrics, "sluice_ttft_seconds_count", **cls) is None
    assert value(metrics, "sluice_slo_requests_total", result="failed", **cls) is None
    assert value(metrics, "sluice_proxy_overhead_seconds_count") == 0


def test_an_outcome_without_the_admission_fields_still_counts() -> None:
    metrics = SluiceMetrics()
    plain = RequestOutcome(
        "r",
        "POST",
        "/v1/completions",
        received_at=5.0,
        replica="emu-1",
        status=502,
        dispatched_at=5.001,
        finished_at=5.2,
        error="upstream_error",
    )
    metrics.observe_outcome(plain)
    labels = {"class": "none", "tenant": "none", "decision": "admitted", "reason": "ok"}
    assert value(metrics, "sluice_requests_total", **labels) == 1
    assert value(metrics, "sluice_request_errors_total", error="upstream_error", **{"class": "none"}) == 1
    assert value(metrics, "sluice_observed_ttft_seconds_count", replica="emu-1") is None


# -- scrape-time collector -----------------------------------------------------------------------------
def _registry() -> ReplicaRegistry:
    settings = Settings(
        replicas=[
            ReplicaSettings(name="emu-0", url="http://127.0.0.1:8001"),
            ReplicaSettings(name="emu-1", url="http://127.0.0.1:8002"),
        ]
    )
    return ReplicaRegistry(SettingsStore(settings))


def test_scrape_parses_count_by_parser_with_their_cpu_seconds() -> None:
    metrics = SluiceMetrics()
    metrics.observe_parse("emu-0", 0.012, False)
    metrics.observe_parse("emu-0", 0.0005, True)
    metrics.observe_parse("emu-0", 0.0007, True)

    assert value(metrics, "sluice_replica_scrape_parses_total", replica="emu-0", parser="library") == 1
    assert value(metrics, "sluice_replica_scrape_parses_total", replica="emu-0", parser="kept_layout") == 2
    library = value(metrics, "sluice_replica_scrape_parse_seconds_total", replica="emu-0", parser="library")
    kept = value(metrics, "sluice_replica_scrape_parse_seconds_total", replica="emu-0", parser="kept_layout")
    assert library == pytest.approx(0.012)
    assert kept == pytest.approx(0.0012)


def test_replica_state_snapshot_and_fit_are_read_at_scrape_time() -> None:
    now = [1000.0]
    metrics = SluiceMetrics(clock=lambda: now[0])
    registry = _registry()
    metrics.track_replicas(registry)
    healthy, dead = registry.replicas()
    healthy.record(True, HealthSettings())
    dead.record(False, HealthSettings(), error="refused")
    with registry.lease(healthy):
        assert value(metrics, "sluice_replica_in_flight_requests", replica="emu-0") == 1
    assert value(metrics, "sluice_replica_in_flight_requests", replica="emu-0") == 0
    assert value(metrics, "sluice_replica_healthy", replica="emu-0") == 1
    assert value(metrics, "sluice_replica_healthy", replica="emu-1") == 0
    assert value(metrics, "sluice_replica_state", replica="emu-1", state="unhealthy") == 1
    assert value(metrics, "sluice_replica_state", replica="emu-1", state="healthy") == 0

    metrics.observe_snapshot(
        ReplicaSnapshot(
            name="emu-0", taken_at=998.0, metrics_at=996.0, kv_cache_usage=0.42, num_running=3, num_waiting=1
        )
    )
    metrics.observe_snapshot(
        ReplicaSnapshot(name="emu-1", taken_at=999.0, stale=True, stale_reason="refused")
    )
    assert value(metrics, "sluice_replica_metrics_age_seconds", replica="emu-0") == 4.0
    assert value(metrics, "sluice_replica_kv_cache_usage_ratio", replica="emu-0") == 0.42
    assert value(metrics, "sluice_replica_requests_running", replica="emu-0") == 3
    assert value(metrics, "sluice_replica_requests_waiting", replica="emu-0") == 1
    assert value(metrics, "sluice_replica_metrics_stale", replica="emu-1") == 1
    assert value(metrics, "sluice_replica_metrics_age_seconds", replica="emu-1") is None  # never scraped
    assert value(metrics, "sluice_replica_scrapes_total", replica="emu-1", result="stale") == 1

    params = StepParams(0.005, 1e-5, 2e-4, 3e-5, 1e-8, 0.0)
    report = FitReport(
        params=params,
        prior=params,
        source=ModelSource.FITTED,
        observations_total=12,
        observations_kept=12,
        effective_observations=11.5,
        prior_weight=4.0,
        mdape=0.07,
        prior_mdape=0.2,
        rejected=(),
        valid=True,
        reason=None,
    )
    metrics.track_step_models(lambda name: report if name == "emu-0" else None)
    coefficient = "sluice_step_model_coefficient_seconds"
    assert value(metrics, coefficient, replica="emu-0", term="base", model="in_use") == 0.005
    assert value(metrics, coefficient, replica="emu-0", term="decode_seqs", model="prior") == 2e-4
    assert value(metrics, "sluice_step_model_fit_error_ratio", replica="emu-0", model="fit") == 0.07
    assert value(metrics, "sluice_step_model_observations_total", replica="emu-0") == 12
    assert value(metrics, "sluice_step_model_valid", replica="emu-1") is None


def test_removed_replicas_disappear_from_the_exposition() -> None:
    metrics = SluiceMetrics()
    store = SettingsStore(Settings(replicas=[ReplicaSettings(name="old", url="http://127.0.0.1:1")]))
    registry = ReplicaRegistry(store)
    metrics.track_replicas(registry)
    metrics.observe_snapshot(ReplicaSnapshot(name="old", taken_at=1.0, metrics_at=1.0))
    assert value(metrics, "sluice_replica_metrics_stale", replica="old") == 0
    store.swap(Settings(replicas=[ReplicaSettings(name="new", url="http://127.0.0.1:2")]))
    assert value(metrics, "sluice_replica_healthy", replica="old") is None
    assert value(metrics, "sluice_replica_metrics_stale", replica="old") is None
    assert value(metrics, "sluice_replica_healthy", replica="new") == 0


def test_a_replica_draining_beside_its_successor_is_listed_once() -> None:
    metrics = SluiceMetrics()
    store = SettingsStore(Settings(replicas=[ReplicaSettings(name="emu-0", url="http://127.0.0.1:1")]))
    registry = ReplicaRegistry(store)
    metrics.track_replicas(registry)
    (old,) = registry.replicas()
    with registry.lease(old):
        store.swap(Settings(replicas=[ReplicaSettings(name="emu-0", url="http://127.0.0.1:2")]))
        assert [r.name for r in registry.draining()] == ["emu-0"]
        body, _ = metrics.exposition()
        healthy = [
            s
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
            if s.name == "sluice_replica_healthy"
        ]
        assert [s.labels for s in healthy] == [{"replica": "emu-0"}]
        assert value(metrics, "sluice_replica_in_flight_requests", replica="emu-0") == 1
        assert value(metrics, "sluice_replica_state", replica="emu-0", state="unknown") == 1


def test_queue_lengths_are_summed_per_limited_class() -> None:
    metrics = SluiceMetrics()
    metrics.set_known_labels(classes=["interactive", "batch"])
    metrics.track_queue(lambda: {"interactive": 3, "batch": 0, "legacy": 2, "old": 1})
    assert value(metrics, "sluice_queue_length", **{"class": "interactive"}) == 3
    assert value(metrics, "sluice_queue_length", **{"class": "batch"}) == 0
    assert value(metrics, "sluice_queue_length", **{"class": "other"}) == 3


# -- tenants and Redis ----------------------------------------------------------------------------------
def _reservation(tenant: str, *, allowed: bool) -> Reservation:
    limits = TenantLimits(tokens_per_minute=6000, requests_per_minute=60, max_concurrent=4)
    return Reservation(
        request_id="r",
        tenant=tenant,
        allowed=allowed,
        cost_tokens=300.0,
        limits=limits,
        tokens=BucketState(6000, 6000, 5700, 3.0, 0.0),
        requests=BucketState(60, 60, 59, 1.0, 0.0),
        concurrency=ConcurrencyState(limit=4, in_flight=1),
        blocked_by=frozenset(),
        oversize=False,
        retry_after_s=0.0,
        origin="memory",
    )


def test_reservations_and_settles_update_the_tenant_series() -> None:
    metrics = SluiceMetrics()
    metrics.set_known_labels(tenants=["acme"])
    metrics.observe_reservation(_reservation("acme", allowed=True))
    metrics.observe_reservation(_reservation("acme", allowed=False))
    metrics.observe_settle(_reservation("acme", allowed=True), 250.0)
    metrics.observe_settle(_reservation("acme", allowed=False), 999.0)
    metrics.observe_reservation(_reservation("stranger", allowed=True))
    assert value(metrics, "sluice_tenant_tokens_reserved_total", tenant="acme") == 300
    assert value(metrics, "sluice_tenant_tokens_settled_total", tenant="acme") == 250
    assert value(metrics, "sluice_tenant_bucket_remaining", tenant="acme", bucket="tokens") == 5700
    assert value(metrics, "sluice_tenant_bucket_capacity", tenant="acme", bucket="requests") == 60
    assert value(metrics, "sluice_tenant_limit_per_minute", tenant="acme", bucket="tokens") == 6000
    assert value(metrics, "sluice_tenant_in_flight_requests", tenant="acme") == 1
    assert value(metrics, "sluice_tenant_concurrency_limit", tenant="acme") == 4
    assert value(metrics, "sluice_tenant_tokens_reserved_total", tenant="other") == 300


def test_limiter_stats_are_exported_as_counters() -> None:
    metrics = SluiceMetrics()
    assert value(metrics, "sluice_redis_degraded") is None  # not wired: no sample, not a made-up 0
    stats = LimiterStats()
    metrics.track_limiter(stats)
    stats.storage_errors_total, stats.fail_open_total, stats.degraded = 3, 7, True
    assert value(metrics, "sluice_redis_errors_total") == 3
    assert value(metrics, "sluice_redis_fail_open_total") == 7
    assert value(metrics, "sluice_redis_fail_closed_total") == 0
    assert value(metrics, "sluice_redis_degraded") == 1


def test_limiter_stats_of_the_memory_backend_are_not_exported() -> None:
    metrics = SluiceMetrics()
    stats = LimiterStats()
    metrics.track_limiter(stats, redis=False)
    stats.local_cache_rejections_total = 2  # whatever a memory limiter counts, there is no Redis
    for name in (
        "sluice_redis_degraded",
        "sluice_redis_errors_total",
        "sluice_limiter_local_cache_rejections_total",
    ):
        assert value(metrics, name) is None, name


def test_reload_results() -> None:
    metrics = SluiceMetrics()
    assert value(metrics, "sluice_config_last_reload_successful") == 1
    metrics.observe_reload(False)
    assert value(metrics, "sluice_config_last_reload_successful") == 0
    assert value(metrics, "sluice_config_reloads_total", result="failure") == 1
    metrics.observe_reload(True)
    assert value(metrics, "sluice_config_last_reload_successful") == 1
    assert value(metrics, "sluice_config_reloads_total", result="success") == 1


# -- naming rules --------------------------------------------------------------------------------------
def test_every_exported_family_follows_the_naming_rules() -> None:
    metrics = SluiceMetrics()
    metrics.track_replicas(_registry())
    metrics.track_limiter(LimiterStats())
    metrics.track_queue(dict)
    metrics.observe_outcome(outcome(predicted_ttft_s=0.4, predicted_tpot_s=0.1, retry_after_s=1.0))
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain")
    families = [f for f in text_string_to_metric_families(body.decode()) if f.name.startswith("sluice_")]
    assert len(families) >= 40
    for family in families:
        sample_names = {s.name for s in family.samples}
        if family.type == "counter":
            assert all(n.endswith(("_total", "_created")) for n in sample_names), family.name
        if family.type == "histogram":
            assert family.name.endswith(("_seconds", "_ratio")), family.name
        assert not (family.type == "gauge" and family.name.endswith("_total")), family.name
    names = {f.name for f in families}
    assert {
        "sluice_requests",
        "sluice_ttft_seconds",
        "sluice_replica_healthy",
        "sluice_redis_errors",
    } <= names


# -- HTTP ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "address", "scheme", "path"),
    [
        ("http://10.0.0.5:8000", "10.0.0.5:8000", "http", "/metrics"),
        ("https://llm.example.com/team-a/", "llm.example.com:443", "https", "/team-a/metrics"),
        ("http://emu-0", "emu-0:80", "http", "/metrics"),
        ("http://[::1]:8000", "[::1]:8000", "http", "/metrics"),
    ],
    ids=["host-port", "https-prefix", "default-port", "ipv6"],
)
def test_replica_targets(url: str, address: str, scheme: str, path: str) -> None:
    registry = ReplicaRegistry(SettingsStore(Settings(replicas=[ReplicaSettings(name="r1", url=url)])))
    (group,) = replica_targets(registry.replicas())
    assert group == {
        "targets": [address],
        "labels": {"__scheme__": scheme, "__metrics_path__": path, "replica": "r1", "backend": "vllm"},
    }


async def test_install_serves_metrics_and_replica_discovery(aiohttp_client: Any) -> None:
    settings = Settings(
        replicas=[ReplicaSettings(name="emu-0", url="http://127.0.0.1:9")],
        health=HealthSettings(interval_s=300.0, timeout_s=0.5),
        server=ServerSettings(port=0),
    )
    app = build_app(SettingsStore(settings), spawn_emulators=False)
    metrics = app[METRICS]  # build_app installs the metrics
    assert app[METRICS] is metrics
    assert metrics.observe_outcome in app[OUTCOME_LISTENERS]
    client = await aiohttp_client(app)

    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(await resp.text())
        for s in family.samples
    }
    assert samples[("sluice_replica_healthy", (("replica", "emu-0"),))] == 0  # port 9 refuses
    assert samples[("sluice_config_last_reload_successful", ())] == 1
    assert math.isfinite(samples[("sluice_config_last_reload_success_timestamp_seconds", ())])

    resp = await client.get("/metrics/replicas")
    assert resp.status == 200
    assert await resp.json() == [
        {
            "targets": ["127.0.0.1:9"],
            "labels": {
                "__scheme__": "http",
                "__metrics_path__": "/metrics",
                "replica": "emu-0",
                "backend": "vllm",
            },
        }
    ]
