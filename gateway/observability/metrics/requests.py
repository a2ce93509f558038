"""Requests and admission: decisions, responses, errors, tokens, Retry-After, queue wait,
latency as clients see it, SLO results, and, read at scrape time, the queue's length, the
attainment controller's state (each class's margin and measured attainment per replica) and each
class's admission by prompt-size quartile (``size_fairness``).

``RequestMetrics.observe`` is the hot path (once per finished request); it takes the class and
tenant labels already limited by ``SluiceMetrics``. ``QueueCollector`` reads the admission
queue's per-class lengths when /metrics is scraped; with no queue wired it yields no samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.observability.metrics.buckets import (
    DURATION_BUCKETS,
    QUEUE_WAIT_BUCKETS,
    RETRY_AFTER_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
)
from gateway.observability.metrics.children import Children
from gateway.observability.metrics.labels import LabelLimits, code_label
from gateway.observability.metrics.outcomes import (
    client_ttft_s,
    decision_of,
    number_field,
    observed_tpot_s,
    slo_result,
)
from gateway.observability.outcome import RequestOutcome

#: The admission queue's waiting requests per class name (any names; limited when exported).
QueueSource = Callable[[], Mapping[str, int]]


class AttainmentRow(Protocol):
    """One (class, replica) of the attainment controller (``gateway.admission.attainment``)."""

    @property
    def request_class(self) -> str: ...

    @property
    def replica(self) -> str: ...

    @property
    def margin(self) -> float: ...

    @property
    def attainment(self) -> float | None: ...

    @property
    def samples(self) -> int: ...

    @property
    def target(self) -> float: ...


#: The attainment controller's rows now.
AttainmentSource = Callable[[], Iterable[AttainmentRow]]


class QuartileRow(Protocol):
    """One class's prompt-size quartile (``gateway.admission.size_share.QuartileRow``)."""

    @property
    def request_class(self) -> str: ...

    @property
    def quartile(self) -> int: ...

    @property
    def decided(self) -> int: ...

    @property
    def admitted(self) -> int: ...

    @property
    def protected(self) -> bool: ...


#: Each class's prompt-size quartiles now.
SizeShareSource = Callable[[], Iterable[QuartileRow]]


class RequestMetrics:
    """The per-request series, registered in ``registry`` at construction (in exposition order)."""

    def __init__(self, registry: CollectorRegistry, children: Children) -> None:
        self._children = children
        r = registry
        # Traffic and decisions.
        self.requests = Counter(
            "sluice_requests_total",
            "Requests decided, by class, tenant, decision (admitted, rejected, shadow_rejected) and reason.",
            ["class", "tenant", "decision", "reason"],
            registry=r,
        )
        self.responses = Counter(
            "sluice_responses_total",
            "Responses sent, by class and HTTP status.",
            ["class", "status"],
            registry=r,
        )
        self.request_errors = Counter(
            "sluice_request_errors_total",
            "Requests that ended with an error code (upstream_error, replica_rejected, client_disconnected).",
            ["class", "error"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens_total",
            "Prompt tokens the replicas reported.",
            ["class", "tenant"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "sluice_completion_tokens_total",
            "Completion tokens the replicas reported.",
            ["class", "tenant"],
            registry=r,
        )
        self.retry_after = Histogram(
            "sluice_retry_after_seconds",
            "Retry-After sent with rejections, in seconds, by class and reason (overloaded, "
            "slo_unattainable, deadline_exceeded, no_healthy_replica; tenant budgets: tokens, requests, "
            "concurrency).",
            ["class", "reason"],
            buckets=RETRY_AFTER_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "sluice_queue_wait_seconds",
            "Seconds requests spent in Sluice's queue (0 when dispatched at once), by class and decision.",
            ["class", "decision"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )

        # Latency as clients see it, and SLO results.
        self.ttft = Histogram(
            "sluice_ttft_seconds",
            "Time to first token from arrival at Sluice (queue included), streamed requests.",
            ["class"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "sluice_tpot_seconds",
            "Time per output token after the first, streamed requests with >= 2 tokens.",
            ["class"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "sluice_request_duration_seconds",
            "Seconds from arrival at Sluice to the end of the response or stream.",
            ["class"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.slo = Counter(
            "sluice_slo_requests_total",
            "Admitted requests judged against their targets, by class and result "
            "(met, missed_ttft, missed_tpot, missed_both, missed_e2e, failed, abandoned).",
            ["class", "result"],
            registry=r,
        )

    def observe(self, outcome: RequestOutcome, cls: str, tenant: str) -> None:
        """Count one finished request of class label ``cls`` and tenant label ``tenant``:
        decision, status, error, tokens, queue wait, Retry-After, latencies and SLO result."""
        counter = self._children.counter
        decision, reason = decision_of(outcome)
        counter(self.requests, cls, tenant, decision, reason)(1)
        if outcome.status is not None:
            counter(self.responses, cls, str(outcome.status))(1)
        if outcome.error is not None:
            counter(self.request_errors, cls, code_label(outcome.error))(1)
        self._observe_tokens(outcome, cls, tenant)
        self._observe_admission(outcome, cls, decision, reason)
        self._observe_latency(outcome, cls)
        result = slo_result(outcome)
        if result is not None:
            counter(self.slo, cls, result)(1)

    def _observe_tokens(self, outcome: RequestOutcome, cls: str, tenant: str) -> None:
        if outcome.prompt_tokens:
            self._children.child(self.prompt_tokens, cls, tenant).inc(outcome.prompt_tokens)
        if outcome.completion_tokens:
            self._children.child(self.completion_tokens, cls, tenant).inc(outcome.completion_tokens)

    def _observe_admission(self, outcome: RequestOutcome, cls: str, decision: str, reason: str) -> None:
        wait = number_field(outcome, "queue_wait_s")
        if wait is not None:
            self._children.observer(self.queue_wait, cls, decision)(max(0.0, wait))
        retry_after = number_field(outcome, "retry_after_s")
        if retry_after is not None and decision == "rejected":
            self._children.observer(self.retry_after, cls, reason)(max(0.0, retry_after))

    def _observe_latency(self, outcome: RequestOutcome, cls: str) -> None:
        observer = self._children.observer
        duration = outcome.duration_s
        if duration is not None:
            observer(self.duration, cls)(max(0.0, duration))
        ttft = client_ttft_s(outcome)
        if ttft is not None:
            observer(self.ttft, cls)(max(0.0, ttft))
        tpot = observed_tpot_s(outcome)
        if tpot is not None:
            observer(self.tpot, cls)(tpot)


class QueueCollector(Collector):
    """``sluice_queue_length`` per class label, read from ``source`` at every scrape (summed over
    the names that share a label); no samples while ``source`` is ``None``."""

    def __init__(self, labels: LabelLimits) -> None:
        self._labels = labels
        self.source: QueueSource | None = None

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily]:
        return (
            GaugeMetricFamily("sluice_queue_length", "Requests waiting in Sluice's queue.", labels=["class"]),
        )

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        (length,) = self._families()
        if self.source is not None:
            totals: dict[str, int] = {}
            for name, count in self.source().items():
                label = self._labels.class_label(name)
                totals[label] = totals.get(label, 0) + count
            for label, count in sorted(totals.items()):
                length.add_metric([label], float(count))
        yield length


class AttainmentCollector(Collector):
    """The attainment controller's state per class label and replica, read from ``source`` at
    every scrape: ``sluice_admission_margin`` (the margin admission applies to the class's
    forecasts there, a fraction), ``sluice_admission_attainment_ratio`` (share of the window's
    ended admitted requests that met both targets; no sample while the window is empty),
    ``sluice_admission_attainment_samples`` and ``sluice_admission_attainment_target_ratio``.
    Names that share a class label (``other``) keep the largest margin, the smallest attainment.
    No samples while ``source`` is ``None``."""

    def __init__(self, labels: LabelLimits) -> None:
        self._labels = labels
        self.source: AttainmentSource | None = None

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        by = ["class", "replica"]
        return (
            GaugeMetricFamily(
                "sluice_admission_margin",
                "Margin admission applies to the class's forecasts on the replica (forecast x (1 + margin)), "
                "held by the attainment controller.",
                labels=by,
            ),
            GaugeMetricFamily(
                "sluice_admission_attainment_ratio",
                "Share of the class's admitted requests on the replica, in the controller's window, that "
                "met both targets.",
                labels=by,
            ),
            GaugeMetricFamily(
                "sluice_admission_attainment_samples",
                "Ended admitted requests in the attainment controller's window.",
                labels=by,
            ),
            GaugeMetricFamily(
                "sluice_admission_attainment_target_ratio",
                "The class's attainment_target.",
                labels=["class"],
            ),
        )

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        margin, attained, samples, target = self._families()
        if self.source is not None:
            margins: dict[tuple[str, str], float] = {}
            shares: dict[tuple[str, str], float] = {}
            counts: dict[tuple[str, str], int] = {}
            targets: dict[str, float] = {}
            for row in self.source():
                label = self._labels.class_label(row.request_class)
                key = (label, row.replica)
                margins[key] = max(margins.get(key, row.margin), row.margin)
                counts[key] = counts.get(key, 0) + row.samples
                if row.attainment is not None:
                    shares[key] = min(shares.get(key, row.attainment), row.attainment)
                targets[label] = max(targets.get(label, row.target), row.target)
            for key, value in sorted(margins.items()):
                margin.add_metric(list(key), value)
                samples.add_metric(list(key), float(counts[key]))
            for key, value in sorted(shares.items()):
                attained.add_metric(list(key), value)
            for label, value in sorted(targets.items()):
                target.add_metric([label], value)
        yield margin
        yield attained
        yield samples
        yield target


class SizeShareCollector(Collector):
    """Each class label's admission by prompt-size quartile over ``size_fairness``'s window, read
    from ``source`` at every scrape: ``sluice_admission_prompt_quartile_decided`` (requests
    admitted or refused), ``sluice_admission_prompt_quartile_admitted_ratio`` (admitted / decided;
    no sample for a quartile with none) and ``sluice_admission_prompt_quartile_protected`` (1 while
    its requests are protected). Labels ``class`` and ``quartile`` (1 shortest .. 4 longest); rows
    sharing them (routes, names limited to ``other``) are summed, protected if any is. No samples
    while ``source`` is ``None``."""

    def __init__(self, labels: LabelLimits) -> None:
        self._labels = labels
        self.source: SizeShareSource | None = None

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        by = ["class", "quartile"]
        return (
            GaugeMetricFamily(
                "sluice_admission_prompt_quartile_decided",
                "Requests of the class admitted or refused in the size-fairness window, by prompt-size "
                "quartile (1 shortest .. 4 longest).",
                labels=by,
            ),
            GaugeMetricFamily(
                "sluice_admission_prompt_quartile_admitted_ratio",
                "Share of those requests admitted, by prompt-size quartile.",
                labels=by,
            ),
            GaugeMetricFamily(
                "sluice_admission_prompt_quartile_protected",
                "1 while the quartile's requests are protected (admitted below min_share of the best "
                "quartile's rate), else 0.",
                labels=by,
            ),
        )

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        decided, ratio, protected = self._families()
        if self.source is not None:
            counts: dict[tuple[str, str], list[int]] = {}
            flags: dict[tuple[str, str], bool] = {}
            for row in self.source():
                key = (self._labels.class_label(row.request_class), str(row.quartile))
                total = counts.setdefault(key, [0, 0])
                total[0] += row.decided
                total[1] += row.admitted
                flags[key] = flags.get(key, False) or row.protected
            for key, (n, admitted) in sorted(counts.items()):
                decided.add_metric(list(key), float(n))
                if n:
                    ratio.add_metric(list(key), admitted / n)
                protected.add_metric(list(key), 1.0 if flags[key] else 0.0)
        yield decided
        yield ratio
        yield protected
