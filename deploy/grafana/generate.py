"""Sluice's Grafana dashboards, written as data: ``python deploy/grafana/generate.py`` rewrites
``deploy/grafana/dashboards/*.json`` from the panel lists below.

Why a generator: four dashboards of hand-edited JSON drift (a renamed metric, a panel whose
query nobody ran). Here every panel is one ``Panel`` with its PromQL; the JSON is derived; and
``tests/observability/test_dashboards.py`` checks that the committed JSON is what this file
produces, that every query parses and returns data against a real Prometheus, and that
``docs/dashboards.md`` describes every panel.

Conventions: rates use ``$__rate_interval``; the variables ``$class``, ``$replica`` and
``$tenant`` are multi-value with ``.*`` for "All", so queries match them with ``=~``. Replica
series (``vllm:*``) carry the ``replica`` label Prometheus gets from Sluice's service discovery
(``deploy/prometheus/prometheus.yml``), so they line up with ``sluice_replica_*``. Grafana's
datasource is the ``datasource`` variable (provisioned: uid ``prometheus``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards"
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Target:
    """One query of a panel; ``legend`` is Grafana's legend format (``{{label}}``)."""

    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    """A panel: ``kind`` is timeseries, stat, table or heatmap; ``unit`` a Grafana unit id.

    ``red_above`` / ``red_below``: the value at which the panel turns red (stat panels and
    timeseries thresholds); ``amber``: an optional warning step before red.
    """

    title: str
    description: str
    targets: tuple[Target, ...]
    kind: str = "timeseries"
    unit: str = "short"
    width: int = 12
    height: int = 8
    red_above: float | None = None
    red_below: float | None = None
    amber: float | None = None
    mappings: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class Variable:
    """A multi-value query variable ``$name`` over ``label_values(metric, name)``; ``label`` is shown."""

    name: str
    label: str
    metric: str


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    panels: tuple[Panel, ...] = field(default=())


def q50_90(metric: str, by: str, selector: str) -> tuple[Target, Target]:
    """p50 and p90 of a histogram ``metric`` per ``by``, over ``$__rate_interval``."""

    def target(q: float) -> Target:
        return Target(
            f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"{{{{{by}}}}} p{int(q * 100)}",
        )

    return target(0.5), target(0.9)


def mean_of(metric: str, by: str, selector: str) -> str:
    """Mean of a histogram or summary per ``by``: rate of its sum over rate of its count."""
    return (
        f"sum by ({by}) (rate({metric}_sum{{{selector}}}[{RATE}]))"
        f" / sum by ({by}) (rate({metric}_count{{{selector}}}[{RATE}]))"
    )


CLS = 'class=~"$class"'
REP = 'replica=~"$replica"'
TEN = 'tenant=~"$tenant"'

OVERVIEW = Dashboard(
    uid="sluice-overview",
    title="Sluice / Overview",
    description="Traffic, admission decisions, goodput and SLO attainment by class, Retry-After, overhead.",
    variables=(Variable("class", "Class", "sluice_requests_total"),),
    panels=(
        Panel(
            "Healthy replicas",
            "Replicas that pass their health checks and take traffic. Red at 0: every request gets 503.",
            (Target("sum(sluice_replica_healthy)"),),
            kind="stat",
            width=6,
            height=4,
            red_below=1,
        ),
        Panel(
            "Rejected share (5m)",
            "Share of requests rejected over the last 5 minutes. Amber above 10 %, red above 25 %.",
            (
                Target(
                    f'(sum(rate(sluice_requests_total{{decision="rejected", {CLS}}}[5m]))'
                    f" or sum(rate(sluice_requests_total{{{CLS}}}[5m])) * 0)"
                    f" / sum(rate(sluice_requests_total{{{CLS}}}[5m]))"
                ),
            ),
            kind="stat",
            unit="percentunit",
            width=6,
            height=4,
            amber=0.1,
            red_above=0.25,
        ),
        Panel(
            "SLO attainment (5m)",
            "Share of admitted requests that met both their TTFT and TPOT targets. Red below 90 %.",
            (
                Target(
                    f"sum(class:sluice_goodput:rate5m{{{CLS}}}) / "
                    f"sum(class:sluice_slo_judged:rate5m{{{CLS}}})"
                ),
            ),
            kind="stat",
            unit="percentunit",
            width=6,
            height=4,
            amber=0.95,
            red_below=0.9,
        ),
        Panel(
            "Config reload",
            "Whether the last configuration reload succeeded. Red: the file on disk was rejected.",
            (Target("min(sluice_config_last_reload_successful)"),),
            kind="stat",
            width=6,
            height=4,
            red_below=1,
            mappings=(("0", "rejected", "red"), ("1", "ok", "green")),
        ),
        Panel(
            "Requests by decision",
            "Requests per second: admitted, rejected, and shadow_rejected (admitted, but a rule in shadow "
            "mode would have rejected them).",
            (Target(f"sum by (decision) (rate(sluice_requests_total{{{CLS}}}[{RATE}]))", "{{decision}}"),),
            unit="reqps",
        ),
        Panel(
            "Rejections by reason",
            "Rejections per second by class and reason (overloaded, slo_unattainable, deadline_exceeded, "
            "prompt_too_large, tenant limits, no_healthy_replica).",
            (
                Target(
                    "sum by (class, reason) "
                    f'(rate(sluice_requests_total{{decision="rejected", {CLS}}}[{RATE}]))',
                    "{{class}} {{reason}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Shadow-mode decisions",
            "Requests a rule in shadow mode would have rejected (shadow_rejected, by reason) or held in "
            "Sluice's queue (shadow_queued, by blocking constraint), by class; they were admitted.",
            (
                Target(
                    f"sum by (class, decision, reason) "
                    f'(rate(sluice_requests_total{{decision=~"shadow_.*", {CLS}}}[{RATE}]))',
                    "{{class}} {{decision}} {{reason}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Responses by status",
            "Responses per second by HTTP status (429: rejected for load, 503: nothing healthy or "
            "limiter down, 502: replica failure, 499: client left).",
            (Target(f"sum by (status) (rate(sluice_responses_total{{{CLS}}}[{RATE}]))", "{{status}}"),),
            unit="reqps",
        ),
        Panel(
            "Goodput by class",
            "Requests per second that met both targets (5-minute rate), per class.",
            (Target(f"class:sluice_goodput:rate5m{{{CLS}}}", "{{class}}"),),
            unit="reqps",
        ),
        Panel(
            "SLO attainment by class",
            "Share of admitted requests per class that met both targets (5-minute window). Red below 90 %.",
            (Target(f"class:sluice_slo_attainment:ratio_rate5m{{{CLS}}}", "{{class}}"),),
            unit="percentunit",
            red_below=0.9,
        ),
        Panel(
            "Admission margin and attainment by replica",
            "Per class and replica: the margin the attainment controller holds (admission multiplies "
            "the class's forecasts there by 1 + margin; starts at forecast_margin), and the share of "
            "its last ended admitted requests there that met both targets, against the class's "
            "attainment_target. Red below 90 %.",
            (
                Target(
                    f"max by (class, replica) (sluice_admission_margin{{{CLS}}})",
                    "{{class}} {{replica}} margin",
                ),
                Target(
                    f"min by (class, replica) (sluice_admission_attainment_ratio{{{CLS}}})",
                    "{{class}} {{replica}} attainment",
                ),
                Target(
                    f"max by (class) (sluice_admission_attainment_target_ratio{{{CLS}}})",
                    "{{class}} target",
                ),
            ),
            unit="percentunit",
            red_below=0.9,
        ),
        Panel(
            "SLO misses by kind",
            "Admitted requests per second that missed: TTFT, TPOT, both, the end-to-end budget "
            "(non-streamed), or failed.",
            (
                Target(
                    "sum by (class, result) "
                    f'(rate(sluice_slo_requests_total{{result!="met", {CLS}}}[{RATE}]))',
                    "{{class}} {{result}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "TTFT seen by clients",
            "Time to first token from arrival at Sluice (queue included), streamed requests, p50 and p90.",
            q50_90("sluice_ttft_seconds", "class", CLS),
            unit="s",
        ),
        Panel(
            "TPOT seen by clients",
            "Time per output token after the first, streamed requests, p50 and p90.",
            q50_90("sluice_tpot_seconds", "class", CLS),
            unit="s",
        ),
        Panel(
            "Queue length by class",
            "Requests waiting in Sluice's queue for a replica that can meet their targets.",
            (Target(f"sum by (class) (sluice_queue_length{{{CLS}}})", "{{class}}"),),
            width=8,
        ),
        Panel(
            "Queue wait by class",
            "Seconds requests spent in Sluice's queue (0 when dispatched at once), p50 and p90.",
            q50_90("sluice_queue_wait_seconds", "class", CLS),
            unit="s",
            width=8,
        ),
        Panel(
            "Retry-After given",
            "Retry-After sent with rejections, p50 and p90 per class and reason: for load (overloaded, "
            "slo_unattainable...) when Sluice predicts room; for a tenant budget (tokens, requests...) "
            "when the bucket holds the request again.",
            tuple(
                Target(
                    f"histogram_quantile({q}, sum by (class, reason, le) "
                    f"(rate(sluice_retry_after_seconds_bucket{{{CLS}}}[{RATE}])))",
                    f"{{{{class}}}} {{{{reason}}}} p{int(q * 100)}",
                )
                for q in (0.5, 0.9)
            ),
            unit="s",
            width=8,
        ),
        Panel(
            "Tokens per second",
            "Prompt and completion tokens per second, as the replicas reported them.",
            (
                Target(f"sum(rate(sluice_prompt_tokens_total{{{CLS}}}[{RATE}]))", "prompt"),
                Target(f"sum(rate(sluice_completion_tokens_total{{{CLS}}}[{RATE}]))", "completion"),
            ),
            width=6,
        ),
        Panel(
            "Errors by code",
            "Requests per second that ended with an error: upstream_error (replica failed), "
            "replica_rejected (replica answered 4xx), client_disconnected.",
            (Target(f"sum by (error) (rate(sluice_request_errors_total{{{CLS}}}[{RATE}]))", "{{error}}"),),
            unit="reqps",
            width=6,
        ),
        Panel(
            "Time in Sluice per request",
            "Seconds Sluice itself spends on a request before dispatch (queue wait excluded), p50 and "
            "p99. Red above 50 ms.",
            (
                Target(
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(sluice_proxy_overhead_seconds_bucket[{RATE}])))",
                    "p50",
                ),
                Target(
                    "histogram_quantile(0.99, sum by (le) "
                    f"(rate(sluice_proxy_overhead_seconds_bucket[{RATE}])))",
                    "p99",
                ),
            ),
            unit="s",
            width=6,
            red_above=0.05,
        ),
        Panel(
            "Gateway CPU",
            "CPU seconds per second used by each gateway process (1 = one core busy).",
            (Target(f'rate(process_cpu_seconds_total{{job="sluice"}}[{RATE}])', "{{instance}}"),),
            unit="percentunit",
            width=6,
            amber=0.7,
            red_above=0.9,
        ),
    ),
)

REPLICAS = Dashboard(
    uid="sluice-replicas",
    title="Sluice / Replicas",
    description="Each replica as Sluice sees it next to its own vLLM metrics: health, queue, KV, step "
    "model, predicted against actual latency.",
    variables=(Variable("replica", "Replica", "sluice_replica_healthy"),),
    panels=(
        Panel(
            "Replica health",
            "1 when the replica passes its health checks and takes traffic. Red at 0.",
            (Target(f"max by (replica) (sluice_replica_healthy{{{REP}}})", "{{replica}}"),),
            kind="stat",
            width=8,
            height=5,
            red_below=1,
            mappings=(("0", "down", "red"), ("1", "up", "green")),
        ),
        Panel(
            "Metrics age",
            "Seconds since Sluice last read the replica's /metrics. Red above 10 s: admission runs on "
            "its own accounting with a safety margin.",
            (Target(f"max by (replica) (sluice_replica_metrics_age_seconds{{{REP}}})", "{{replica}}"),),
            kind="stat",
            unit="s",
            width=8,
            height=5,
            amber=3,
            red_above=10,
        ),
        Panel(
            "Scrapes by result",
            "Sluice's scrapes of each replica's /metrics per second: ok, or stale (failed).",
            (
                Target(
                    f"sum by (replica, result) (rate(sluice_replica_scrapes_total{{{REP}}}[{RATE}]))",
                    "{{replica}} {{result}}",
                ),
            ),
            width=8,
            height=5,
        ),
        Panel(
            "Requests in flight: Sluice vs replica",
            "Requests Sluice has outstanding on each replica, against the replica's own running + "
            "waiting (vLLM). A gap means other clients use the replica, or requests Sluice gave up on.",
            (
                Target(
                    f"sum by (replica) (sluice_replica_in_flight_requests{{{REP}}})", "{{replica}} sluice"
                ),
                Target(
                    f"sum by (replica) (vllm:num_requests_running{{{REP}}})"
                    f" + sum by (replica) (vllm:num_requests_waiting{{{REP}}})",
                    "{{replica}} vllm",
                ),
            ),
        ),
        Panel(
            "Replica queue",
            "Requests waiting inside each replica (vLLM's own gauge), and the value Sluice last read.",
            (
                Target(f"sum by (replica) (vllm:num_requests_waiting{{{REP}}})", "{{replica}} vllm"),
                Target(f"max by (replica) (sluice_replica_requests_waiting{{{REP}}})", "{{replica}} seen"),
            ),
        ),
        Panel(
            "KV cache use",
            "Fraction of KV-cache blocks in use (vLLM), and the value Sluice last read. Red above 95 %: "
            "preemptions follow.",
            (
                Target(f"avg by (replica) (vllm:kv_cache_usage_perc{{{REP}}})", "{{replica}} vllm"),
                Target(
                    f"max by (replica) (sluice_replica_kv_cache_usage_ratio{{{REP}}})", "{{replica}} seen"
                ),
            ),
            unit="percentunit",
            amber=0.85,
            red_above=0.95,
        ),
        Panel(
            "Preemptions",
            "Requests evicted from the KV cache and recomputed, per second (vLLM). Any sustained rate "
            "means the replica is over-committed.",
            (Target(f"sum by (replica) (rate(vllm:num_preemptions_total{{{REP}}}[{RATE}]))", "{{replica}}"),),
            red_above=0.1,
        ),
        Panel(
            "Decode step time",
            "Mean time between output tokens of one request on each replica (vLLM inter-token latency), "
            "the step time the step model predicts.",
            (Target(mean_of("vllm:inter_token_latency_seconds", "replica", REP), "{{replica}}"),),
            unit="s",
        ),
        Panel(
            "Tokens per engine step",
            "Mean tokens (prompt + generated) per engine step (vLLM): the batch size the step model sees.",
            (Target(mean_of("vllm:iteration_tokens_total", "replica", REP), "{{replica}}"),),
        ),
        Panel(
            "Step-model fit error",
            "Median relative error of the fitted step model on recent observations, and of the roofline "
            "prior alone. Red above 30 %.",
            (
                Target(
                    f'max by (replica) (sluice_step_model_fit_error_ratio{{model="fit", {REP}}})',
                    "{{replica}} fit",
                ),
                Target(
                    f'max by (replica) (sluice_step_model_fit_error_ratio{{model="prior", {REP}}})',
                    "{{replica}} prior",
                ),
            ),
            unit="percentunit",
            red_above=0.3,
        ),
        Panel(
            "Forecast correction",
            "Factor Sluice multiplies each replica's engine TTFT and TPOT forecasts by, learned from what "
            "it measured while relaying admitted requests (replica-wide; per load regime in "
            "/sluice/v1/replicas). 1: the step model alone is right; 2: latencies come out twice the "
            "model's.",
            (
                Target(
                    f'max by (replica, kind) (sluice_forecast_correction_factor{{regime="all", {REP}}})',
                    "{{replica}} {{kind}}",
                ),
            ),
            amber=3,
        ),
        Panel(
            "TTFT spread at the 95th percentile",
            "Per replica and TTFT load regime, the factor by which the 95th percentile of measured / "
            "forecast TTFT lies above its median: what admission multiplies the TTFT of a class with "
            "attainment_target 0.95 by on a loaded replica (quantiles 0.8, 0.9 and 0.99 in the same "
            "metric). 1: every request came as corrected; 1.5: one in twenty came 50 % later.",
            (
                Target(
                    f'max by (replica, regime) (sluice_forecast_correction_spread{{quantile="0.95", {REP}}})',
                    "{{replica}} {{regime}}",
                ),
            ),
            amber=2,
        ),
        Panel(
            "Forecast error, corrected vs not",
            "Signed median of measured / forecast - 1 over the last minute's requests per replica: "
            "against the forecast as corrected when it was made, and as the step model alone gave it. "
            "Positive: forecasts were low. Near 0 when corrected. Red above 15 %.",
            (
                Target(
                    "max by (replica, kind, forecast) "
                    f'(sluice_forecast_residual_ratio{{stat="median", {REP}}})',
                    "{{replica}} {{kind}} {{forecast}}",
                ),
            ),
            unit="percentunit",
            red_above=0.15,
        ),
        Panel(
            "Scrape parse CPU",
            "Share of a core Sluice spends parsing each replica's /metrics, by parser: kept_layout (the "
            "values only, the scrape laid out as the last one) or library (prometheus_client's full "
            "parse). Amber above 2 % for one replica.",
            (
                Target(
                    "sum by (replica, parser) "
                    f"(rate(sluice_replica_scrape_parse_seconds_total{{{REP}}}[{RATE}]))",
                    "{{replica}} {{parser}}",
                ),
            ),
            unit="percentunit",
            amber=0.02,
        ),
        Panel(
            "Step-model coefficients",
            "The coefficients in use per replica and term, in seconds per unit (base: per step; "
            "tokens_to_knee, tokens_past_knee: per token; decode_seqs: per sequence; kv_tokens: per KV "
            "token read; attn_pairs: per prefill attention pair).",
            (
                Target(
                    "max by (replica, term) "
                    f'(sluice_step_model_coefficient_seconds{{model="in_use", {REP}}})',
                    "{{replica}} {{term}}",
                    instant=True,
                ),
            ),
            kind="table",
            unit="s",
            width=24,
        ),
        Panel(
            "TTFT: predicted vs observed",
            "Median engine-side time to first token per replica: Sluice's forecast at dispatch, what "
            "Sluice measured from dispatch, and what vLLM measured itself.",
            (
                Target(
                    f"histogram_quantile(0.5, sum by (replica, le) "
                    f"(rate(sluice_predicted_ttft_seconds_bucket{{{REP}}}[{RATE}])))",
                    "{{replica}} predicted",
                ),
                Target(
                    f"histogram_quantile(0.5, sum by (replica, le) "
                    f"(rate(sluice_observed_ttft_seconds_bucket{{{REP}}}[{RATE}])))",
                    "{{replica}} observed",
                ),
                Target(
                    f"histogram_quantile(0.5, sum by (replica, le) "
                    f"(rate(vllm:time_to_first_token_seconds_bucket{{{REP}}}[{RATE}])))",
                    "{{replica}} vllm",
                ),
            ),
            unit="s",
        ),
        Panel(
            "TPOT: predicted vs observed",
            "Median time per output token per replica: Sluice's forecast, what Sluice measured, and "
            "vLLM's own per-request TPOT.",
            (
                Target(
                    f"histogram_quantile(0.5, sum by (replica, le) "
                    f"(rate(sluice_predicted_tpot_seconds_bucket{{{REP}}}[{RATE}])))",
                    "{{replica}} predicted",
                ),
                Target(
                    f"histogram_quantile(0.5, sum by (replica, le) "
                    f"(rate(sluice_observed_tpot_seconds_bucket{{{REP}}}[{RATE}])))",
                    "{{replica}} observed",
                ),
                Target(
                    f"histogram_quantile(0.5, sum by (replica, le) "
                    f"(rate(vllm:request_time_per_output_token_seconds_bucket{{{REP}}}[{RATE}])))",
                    "{{replica}} vllm",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Finished requests by reason",
            "Requests each replica finished per second by reason (vLLM): stop, length, abort, error.",
            (
                Target(
                    f"sum by (replica, finished_reason) (rate(vllm:request_success_total{{{REP}}}[{RATE}]))",
                    "{{replica}} {{finished_reason}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Token throughput",
            "Prompt and generated tokens per second per replica (vLLM).",
            (
                Target(
                    f"sum by (replica) (rate(vllm:prompt_tokens_total{{{REP}}}[{RATE}]))",
                    "{{replica}} prompt",
                ),
                Target(
                    f"sum by (replica) (rate(vllm:generation_tokens_total{{{REP}}}[{RATE}]))",
                    "{{replica}} generated",
                ),
            ),
        ),
    ),
)

TENANTS = Dashboard(
    uid="sluice-tenants",
    title="Sluice / Tenants",
    description="Per-tenant usage against limits, fair share, and the limiter's storage (Redis).",
    variables=(Variable("tenant", "Tenant", "sluice_requests_total"),),
    panels=(
        Panel(
            "Requests by tenant",
            "Requests per second per tenant and decision.",
            (
                Target(
                    f"sum by (tenant, decision) (rate(sluice_requests_total{{{TEN}}}[{RATE}]))",
                    "{{tenant}} {{decision}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Rejections by tenant and reason",
            "Rejections per second per tenant: its own limits (tokens, requests, concurrency, oversize) "
            "or load (overloaded, slo_unattainable...).",
            (
                Target(
                    "sum by (tenant, reason) "
                    f'(rate(sluice_requests_total{{decision="rejected", {TEN}}}[{RATE}]))',
                    "{{tenant}} {{reason}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Tokens used by tenant",
            "Prompt + completion tokens per minute per tenant, as the replicas reported them.",
            (
                Target(
                    f"60 * (sum by (tenant) (rate(sluice_prompt_tokens_total{{{TEN}}}[{RATE}]))"
                    f" + sum by (tenant) (rate(sluice_completion_tokens_total{{{TEN}}}[{RATE}])))",
                    "{{tenant}}",
                ),
            ),
        ),
        Panel(
            "Token budget: used vs limit",
            "Weighted tokens charged per minute per tenant, against its tokens_per_minute limit.",
            (
                Target(
                    f"60 * sum by (tenant) (rate(sluice_tenant_tokens_settled_total{{{TEN}}}[{RATE}]))",
                    "{{tenant}} used",
                ),
                Target(
                    f'max by (tenant) (sluice_tenant_limit_per_minute{{bucket="tokens", {TEN}}})',
                    "{{tenant}} limit",
                ),
            ),
        ),
        Panel(
            "Token bucket level",
            "Share of each tenant's token bucket left after its last reservation. Red below 10 %: the "
            "tenant is about to be rejected for tokens.",
            (
                Target(
                    f'max by (tenant) (sluice_tenant_bucket_remaining{{bucket="tokens", {TEN}}})'
                    f' / max by (tenant) (sluice_tenant_bucket_capacity{{bucket="tokens", {TEN}}})',
                    "{{tenant}}",
                ),
            ),
            unit="percentunit",
            red_below=0.1,
        ),
        Panel(
            "Request bucket level",
            "Share of each tenant's request bucket left after its last reservation. Red below 10 %.",
            (
                Target(
                    f'max by (tenant) (sluice_tenant_bucket_remaining{{bucket="requests", {TEN}}})'
                    f' / max by (tenant) (sluice_tenant_bucket_capacity{{bucket="requests", {TEN}}})',
                    "{{tenant}}",
                ),
            ),
            unit="percentunit",
            red_below=0.1,
        ),
        Panel(
            "Fair share of tokens",
            "Each tenant's share of all weighted tokens charged (sums to 1 over tenants).",
            (
                Target(
                    f"sum by (tenant) (rate(sluice_tenant_tokens_settled_total{{{TEN}}}[{RATE}]))"
                    f" / ignoring (tenant) group_left sum(rate(sluice_tenant_tokens_settled_total[{RATE}]))",
                    "{{tenant}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Reserved vs settled tokens",
            "Weighted tokens per second reserved at admission (prompt + predicted output) and charged "
            "at the end. Reserved far above settled: output predictions are too pessimistic.",
            (
                Target(
                    f"sum by (tenant) (rate(sluice_tenant_tokens_reserved_total{{{TEN}}}[{RATE}]))",
                    "{{tenant}} reserved",
                ),
                Target(
                    f"sum by (tenant) (rate(sluice_tenant_tokens_settled_total{{{TEN}}}[{RATE}]))",
                    "{{tenant}} settled",
                ),
            ),
        ),
        Panel(
            "Concurrent requests vs limit",
            "Each tenant's unsettled requests (all gateways) at its last reservation, and max_concurrent.",
            (
                Target(
                    f"max by (tenant) (sluice_tenant_in_flight_requests{{{TEN}}})", "{{tenant}} in flight"
                ),
                Target(f"max by (tenant) (sluice_tenant_concurrency_limit{{{TEN}}})", "{{tenant}} limit"),
            ),
        ),
        Panel(
            "Redis state",
            "1 while a gateway treats Redis as down and applies its failure policy. Red at 1.",
            (Target("max(sluice_redis_degraded)"),),
            kind="stat",
            width=6,
            red_above=0.5,
            mappings=(("0", "up", "green"), ("1", "down", "red")),
        ),
        Panel(
            "Redis errors and failure-policy decisions",
            "Per second: failed Redis calls, reservations answered locally (fail_open) and refused with "
            "503 (fail_closed).",
            (
                Target(f"sum(rate(sluice_redis_errors_total[{RATE}]))", "errors"),
                Target(f"sum(rate(sluice_redis_fail_open_total[{RATE}]))", "fail open"),
                Target(f"sum(rate(sluice_redis_fail_closed_total[{RATE}]))", "fail closed"),
            ),
            width=12,
        ),
        Panel(
            "Over-limit answers from the local cache",
            "Rejections per second answered from the in-process cache of tenants known to be over limit "
            "(no Redis round trip).",
            (Target(f"sum(rate(sluice_limiter_local_cache_rejections_total[{RATE}]))", "cached"),),
            width=6,
        ),
    ),
)

PREDICTOR = Dashboard(
    uid="sluice-predictor",
    title="Sluice / Predictor",
    description="How good the TTFT and TPOT forecasts are, per replica, over time; the step model's fit.",
    variables=(Variable("replica", "Replica", "sluice_replica_healthy"),),
    panels=(
        Panel(
            "TTFT error, median and p90",
            "Absolute relative error of TTFT forecasts per replica. Targets: median 15 %, p90 35 %. Red "
            "above 30 %.",
            tuple(
                Target(
                    f"histogram_quantile({q}, sum by (replica, le) "
                    f'(rate(sluice_prediction_abs_error_ratio_bucket{{kind="ttft", {REP}}}[{RATE}])))',
                    f"{{{{replica}}}} p{int(q * 100)}",
                )
                for q in (0.5, 0.9)
            ),
            unit="percentunit",
            red_above=0.3,
        ),
        Panel(
            "TPOT error, median and p90",
            "Absolute relative error of TPOT forecasts per replica. Targets: median 10 %, p90 25 %. Red "
            "above 20 %.",
            tuple(
                Target(
                    f"histogram_quantile({q}, sum by (replica, le) "
                    f'(rate(sluice_prediction_abs_error_ratio_bucket{{kind="tpot", {REP}}}[{RATE}])))',
                    f"{{{{replica}}}} p{int(q * 100)}",
                )
                for q in (0.5, 0.9)
            ),
            unit="percentunit",
            red_above=0.2,
        ),
        Panel(
            "Bias: median signed error",
            "Median of (predicted - observed) / observed per replica and kind. Above 0: pessimistic "
            "(rejects what would fit). Below 0: optimistic (admits what then misses).",
            (
                Target(
                    f"histogram_quantile(0.5, sum by (replica, kind, le) "
                    f"(rate(sluice_prediction_error_ratio_bucket{{{REP}}}[{RATE}])))",
                    "{{replica}} {{kind}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "TTFT error distribution",
            "How many TTFT forecasts fell in each signed-error bucket, over time.",
            (
                Target(
                    "sum by (le) "
                    f'(increase(sluice_prediction_error_ratio_bucket{{kind="ttft", {REP}}}[{RATE}]))',
                    "{{le}}",
                ),
            ),
            kind="heatmap",
        ),
        Panel(
            "TPOT error distribution",
            "How many TPOT forecasts fell in each signed-error bucket, over time.",
            (
                Target(
                    "sum by (le) "
                    f'(increase(sluice_prediction_error_ratio_bucket{{kind="tpot", {REP}}}[{RATE}]))',
                    "{{le}}",
                ),
            ),
            kind="heatmap",
        ),
        Panel(
            "Forecasts vs dispatched requests",
            "Requests per second per replica that had a TTFT forecast, and streamed requests dispatched. "
            "Forecasts well below dispatches: the step model is not valid there.",
            (
                Target(
                    f"sum by (replica) (rate(sluice_predicted_ttft_seconds_count{{{REP}}}[{RATE}]))",
                    "{{replica}} forecast",
                ),
                Target(
                    f"sum by (replica) (rate(sluice_observed_ttft_seconds_count{{{REP}}}[{RATE}]))",
                    "{{replica}} dispatched",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Step-model fit error vs prior",
            "Median relative error of step times: fitted model against the roofline prior alone.",
            (
                Target(
                    f"max by (replica, model) (sluice_step_model_fit_error_ratio{{{REP}}})",
                    "{{replica}} {{model}}",
                ),
            ),
            unit="percentunit",
            red_above=0.3,
        ),
        Panel(
            "Step-model observations",
            "Step-time observations the fit accepted per second, per replica. Zero under traffic: the "
            "replica's metrics are stale or unusable.",
            (
                Target(
                    f"sum by (replica) (rate(sluice_step_model_observations_total{{{REP}}}[{RATE}]))",
                    "{{replica}}",
                ),
            ),
            width=6,
        ),
        Panel(
            "Step model valid",
            "1 when the replica's step model can forecast. Red at 0: the replica is only used as a last "
            "resort (unmodelled).",
            (Target(f"min by (replica) (sluice_step_model_valid{{{REP}}})", "{{replica}}"),),
            kind="stat",
            width=6,
            red_below=1,
        ),
        Panel(
            "Engine TTFT: Sluice vs vLLM",
            "Median TTFT per replica as Sluice measures it from dispatch and as vLLM measures it from "
            "arrival. The gap is network plus the replica's HTTP front end.",
            (
                Target(
                    f"histogram_quantile(0.5, sum by (replica, le) "
                    f"(rate(sluice_observed_ttft_seconds_bucket{{{REP}}}[{RATE}])))",
                    "{{replica}} sluice",
                ),
                Target(
                    f"histogram_quantile(0.5, sum by (replica, le) "
                    f"(rate(vllm:time_to_first_token_seconds_bucket{{{REP}}}[{RATE}])))",
                    "{{replica}} vllm",
                ),
            ),
            unit="s",
        ),
    ),
)

DASHBOARDS: tuple[Dashboard, ...] = (OVERVIEW, REPLICAS, TENANTS, PREDICTOR)


# -- JSON ---------------------------------------------------------------------------------------------
def _thresholds(panel: Panel) -> dict[str, Any]:
    if panel.red_below is not None:
        steps: list[dict[str, Any]] = [{"color": "red", "value": None}]
        if panel.amber is not None:
            steps.append({"color": "orange", "value": panel.red_below})
            steps.append({"color": "green", "value": panel.amber})
        else:
            steps.append({"color": "green", "value": panel.red_below})
    else:
        steps = [{"color": "green", "value": None}]
        if panel.amber is not None:
            steps.append({"color": "orange", "value": panel.amber})
        if panel.red_above is not None:
            steps.append({"color": "red", "value": panel.red_above})
    return {"mode": "absolute", "steps": steps}


def _mappings(panel: Panel) -> list[dict[str, Any]]:
    if not panel.mappings:
        return []
    options = {
        value: {"text": text, "color": color, "index": index}
        for index, (value, text, color) in enumerate(panel.mappings)
    }
    return [{"type": "value", "options": options}]


def _target(target: Target, ref_id: str, kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "datasource": DATASOURCE,
        "refId": ref_id,
        "expr": target.expr,
        "legendFormat": target.legend or "__auto",
        "range": not target.instant,
        "instant": target.instant,
    }
    if kind == "heatmap":
        out["format"] = "heatmap"
    elif kind == "table":
        out["format"] = "table"
    return out


def _options(panel: Panel) -> dict[str, Any]:
    if panel.kind == "stat":
        return {
            "colorMode": "background",
            "graphMode": "none",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        }
    if panel.kind == "heatmap":
        return {"calculate": False, "yAxis": {"unit": "percentunit"}, "color": {"scheme": "Oranges"}}
    if panel.kind == "table":
        return {"showHeader": True}
    return {"legend": {"displayMode": "table", "placement": "bottom"}, "tooltip": {"mode": "multi"}}


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": panel.unit,
        "thresholds": _thresholds(panel),
        "mappings": _mappings(panel),
    }
    if panel.kind == "timeseries" and (panel.red_above is not None or panel.red_below is not None):
        defaults["custom"] = {"thresholdsStyle": {"mode": "line+area"}}
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": _options(panel),
        "targets": [_target(t, chr(ord("A") + i), panel.kind) for i, t in enumerate(panel.targets)],
    }


def _variable(variable: Variable) -> dict[str, Any]:
    query = f"label_values({variable.metric}, {variable.name})"
    return {
        "name": variable.name,
        "label": variable.label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "definition": query,
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def render(dashboard: Dashboard) -> dict[str, Any]:
    """The Grafana dashboard JSON model (schema 39) for ``dashboard``."""
    panels: list[dict[str, Any]] = []
    x = y = row_height = 0
    for index, panel in enumerate(dashboard.panels, start=1):
        if x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        panels.append(_panel(panel, index, x, y))
        x += panel.width
        row_height = max(row_height, panel.height)
    datasource_var = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {"selected": False, "text": "Prometheus", "value": "prometheus"},
    }
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["sluice"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "links": [
            {
                "type": "dashboards",
                "tags": ["sluice"],
                "asDropdown": False,
                "title": "Sluice",
                "includeVars": True,
            }
        ],
        "templating": {"list": [datasource_var, *(_variable(v) for v in dashboard.variables)]},
        "annotations": {"list": []},
        "panels": panels,
    }


def rendered() -> dict[str, str]:
    """File name -> JSON text of every dashboard, exactly as committed."""
    return {f"{d.uid}.json": json.dumps(render(d), indent=2, ensure_ascii=False) + "\n" for d in DASHBOARDS}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in rendered().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
