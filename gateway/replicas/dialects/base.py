"""The vocabulary shared by every metrics dialect.

A dialect turns one scrape's ``Samples`` (whatever the engine calls its metrics) into one
``Reading`` in Sluice's canonical quantities: instantaneous ``Gauges``, cumulative counters by
``CounterName`` and cumulative histograms by ``HistogramName``. It does no arithmetic over time:
rates, window means and quantiles are computed by ``gateway.replicas.scrape`` for all dialects
alike. A quantity the engine does not expose is simply missing from the reading.
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

#: One sample's labels and value.
Series = tuple[Mapping[str, str], float]


class CounterName(enum.StrEnum):
    """Cumulative counters a dialect may supply, in the units named."""

    #: Prompt tokens as the engine counts them (vLLM: cache hits included), tokens.
    PROMPT_TOKENS = "prompt_tokens"
    #: Prompt tokens actually computed (prefix-cache hits excluded), tokens.
    COMPUTED_PROMPT_TOKENS = "computed_prompt_tokens"
    GENERATION_TOKENS = "generation_tokens"
    #: Finished requests, every finish reason.
    REQUESTS_FINISHED = "requests_finished"
    PREEMPTIONS = "preemptions"
    #: Prefix-cache lookups and hits, in the engine's unit (vLLM: tokens; ~0.8: blocks).
    PREFIX_CACHE_QUERIES = "prefix_cache_queries"
    PREFIX_CACHE_HITS = "prefix_cache_hits"
    #: Requests the engine itself refused (queue limits; TGI's 429 ``overloaded``).
    ADMISSION_REJECTIONS = "admission_rejections"
    #: Engine steps (forward passes) of every kind, for engines that count them (SGLang's batch
    #: dispatches, TGI's ``tgi_batch_inference_count``).
    STEPS = "steps"
    #: Seconds the engine spent inside steps (SGLang ``forward_execution_seconds_total``).
    STEP_SECONDS = "step_seconds"


class HistogramName(enum.StrEnum):
    """Cumulative histograms a dialect may supply, in the units named."""

    #: Tokens per engine step.
    ITERATION_TOKENS = "iteration_tokens"
    #: Seconds between successive output tokens of a request.
    INTER_TOKEN_LATENCY = "inter_token_latency_s"
    TTFT = "ttft_s"
    QUEUE_TIME = "queue_time_s"
    E2E = "e2e_s"
    #: Prompt / generated tokens per finished request.
    REQUEST_PROMPT_TOKENS = "request_prompt_tokens"
    REQUEST_GENERATION_TOKENS = "request_generation_tokens"
    #: Seconds per engine step as the engine measures it, every kind of step (TGI's
    #: ``tgi_batch_forward_duration``); one observation per step, so its count rate is steps/s.
    STEP_TIME = "step_time_s"
    #: The same for decode-only steps and for steps that prefill (TGI ``method`` label).
    DECODE_STEP_TIME = "decode_step_time_s"
    PREFILL_STEP_TIME = "prefill_step_time_s"
    #: Requests each prefill batch starts (TGI ``tgi_batch_next_size``, buckets 1, 2, ...):
    #: one observation per new batch taken from the queue.
    PREFILL_BATCH_REQUESTS = "prefill_batch_requests"


@dataclass(frozen=True, slots=True)
class Histogram:
    """One classic Prometheus histogram (all its series summed), cumulative since the engine started.

    ``bounds`` are the ``le`` upper bounds read from the scrape, ascending (the last one is
    ``math.inf`` in a complete histogram); ``cumulative[i]`` counts observations ``<= bounds[i]``.
    ``sum`` is the sum of observations, ``count`` their number. Buckets may be empty (no ``le``
    series), then only the mean is available.
    """

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float
    count: float


@dataclass(frozen=True, slots=True)
class Gauges:
    """Instantaneous values of one scrape; ``None`` where the engine did not say."""

    num_running: int | None = None
    num_waiting: int | None = None
    #: Mean over engines, 0-1.
    kv_cache_usage: float | None = None
    #: Fullest engine, 0-1.
    kv_cache_usage_max: float | None = None
    kv_capacity_tokens: int | None = None
    block_size: int | None = None
    #: The engine's own smoothed decode throughput, tokens per second (SGLang ``gen_throughput``).
    decode_tokens_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class Reading:
    """What a dialect read from one scrape.

    ``sources`` maps each canonical quantity found to the engine metric name it was read from,
    so name drift (old vs new names) is visible.
    """

    gauges: Gauges = Gauges()
    counters: Mapping[CounterName, float] = field(default_factory=dict)
    histograms: Mapping[HistogramName, Histogram] = field(default_factory=dict)
    model_names: tuple[str, ...] = ()
    sources: Mapping[str, str] = field(default_factory=dict)

    def is_empty(self) -> bool:
        """True when the scrape held no quantity this dialect knows."""
        return not (self.counters or self.histograms or self.sources)


def matches(labels: Mapping[str, str], where: Mapping[str, str] | None) -> bool:
    """PromQL equality matching: a label the sample lacks counts as the empty string."""
    return where is None or all(labels.get(k, "") == v for k, v in where.items())


class Samples:
    """One scrape's samples, by sample name, with PromQL-like selectors that sum over series.

    Built by ``gateway.replicas.exposition.parse_exposition`` from the prometheus_client parser's
    output. Sample names are as exposed (``vllm:prompt_tokens_total``, ``..._bucket``); ``_created``
    samples and non-finite values were dropped. Every aggregate returns ``None`` when no series
    matched, never 0.
    """

    __slots__ = ("_by_name",)

    def __init__(self, series: Iterable[tuple[str, Mapping[str, str], float]]) -> None:
        by_name: dict[str, list[Series]] = defaultdict(list)
        for name, labels, value in series:
            by_name[name].append((labels, value))
        self._by_name: dict[str, list[Series]] = dict(by_name)

    @classmethod
    def grouped(cls, by_name: dict[str, list[Series]]) -> Samples:
        """Samples already grouped by name (each list non-empty; taken, not copied)."""
        samples = cls.__new__(cls)
        samples._by_name = by_name
        return samples

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        """Number of distinct sample names."""
        return len(self._by_name)

    def names(self) -> frozenset[str]:
        return frozenset(self._by_name)

    def select(self, name: str, where: Mapping[str, str] | None = None) -> list[Series]:
        """The series of sample ``name`` whose labels match ``where``."""
        return [s for s in self._by_name.get(name, ()) if matches(s[0], where)]

    def total(self, name: str, where: Mapping[str, str] | None = None) -> float | None:
        """Sum of the matching series (e.g. over the ``engine`` label)."""
        values = [v for _, v in self.select(name, where)]
        return math.fsum(values) if values else None

    def mean(self, name: str, where: Mapping[str, str] | None = None) -> float | None:
        values = [v for _, v in self.select(name, where)]
        return math.fsum(values) / len(values) if values else None

    def max(self, name: str, where: Mapping[str, str] | None = None) -> float | None:
        values = [v for _, v in self.select(name, where)]
        return max(values) if values else None

    def counter(self, name: str, where: Mapping[str, str] | None = None) -> tuple[str, float] | None:
        """(sample name found, sum of matching series) of a counter exposed without ``_total``.

        prometheus_client's parser renames a counter's bare sample ``x`` to ``x_total``, so a
        counter TGI exposes as ``tgi_request_count`` is looked up under both names.
        """
        for candidate in (name, name + "_total"):
            value = self.total(candidate, where)
            if value is not None:
                return candidate, value
        return None

    def first_present(self, names: Sequence[str], suffix: str = "") -> str | None:
        """The first of ``names`` (aliases, newest first) with a sample ``name + suffix``."""
        return next((n for n in names if n + suffix in self._by_name), None)

    def label_values(self, label: str, name_prefix: str = "") -> tuple[str, ...]:
        """Distinct values of ``label`` over samples whose name starts with ``name_prefix``, sorted."""
        found = {
            labels[label]
            for name, series in self._by_name.items()
            if name.startswith(name_prefix)
            for labels, _ in series
            if label in labels
        }
        return tuple(sorted(found))

    def histogram(self, base: str, where: Mapping[str, str] | None = None) -> Histogram | None:
        """Histogram ``base`` (``_bucket``/``_sum``/``_count``) summed over its matching series.

        ``None`` without ``_sum`` and ``_count``. Buckets are summed per ``le`` (read from the
        scrape, never assumed); only bounds every series has are kept, so series with different
        layouts cannot produce a bucket that misses some of them.
        """
        total_sum = self.total(base + "_sum", where)
        total_count = self.total(base + "_count", where)
        if total_sum is None or total_count is None:
            return None
        per_series: dict[tuple[tuple[str, str], ...], dict[float, float]] = defaultdict(dict)
        for labels, value in self.select(base + "_bucket", where):
            le = _parse_le(labels.get("le"))
            if le is None:
                continue
            key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
            per_series[key][le] = value
        bounds: tuple[float, ...] = ()
        cumulative: tuple[float, ...] = ()
        if per_series:
            common = set.intersection(*(set(b) for b in per_series.values()))
            bounds = tuple(sorted(common))
            cumulative = tuple(math.fsum(b[le] for b in per_series.values()) for le in bounds)
        return Histogram(bounds=bounds, cumulative=cumulative, sum=total_sum, count=total_count)


def _parse_le(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        return float(raw)  # "+Inf" parses to inf
    except ValueError:
        return None


class Dialect(Protocol):
    """Reads one engine family's metric names. Stateless; one shared instance per dialect.

    ``name`` is the key it is registered and configured under (``"vllm"``). ``read`` must not
    raise on missing metrics: it leaves them out of the ``Reading``. ``prefix`` is what every one
    of its metric names starts with (``"vllm:"``, ``"tgi_"``, ``"sglang:"``), which is how a
    scrape's engine is detected.
    """

    @property
    def prefix(self) -> str: ...

    @property
    def name(self) -> str: ...

    def read(self, samples: Samples) -> Reading: ...
