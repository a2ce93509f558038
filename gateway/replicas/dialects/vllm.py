"""vLLM's ``/metrics`` (V1 names, with the older V0 / pre-0.11 names as fallbacks).

Names: ``shared/reference/backend-metrics.md`` §1. Each quantity is looked up by name with
aliases, newest first, and the name used is recorded in ``Reading.sources``. Series are summed over
``engine`` (data-parallel ranks) and other labels, except KV usage (mean and max over engines);
capacity is ``kv_cache_size_tokens`` when present, else ``num_gpu_blocks * block_size``.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.replicas.dialects.base import CounterName, Gauges, Histogram, HistogramName, Reading, Samples

PREFIX = "vllm:"

#: Counter -> (sample name, label filter) aliases, newest first.
COUNTERS: Mapping[CounterName, tuple[tuple[str, Mapping[str, str] | None], ...]] = {
    CounterName.PROMPT_TOKENS: (("vllm:prompt_tokens_total", None),),
    CounterName.COMPUTED_PROMPT_TOKENS: (
        ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    ),
    CounterName.GENERATION_TOKENS: (("vllm:generation_tokens_total", None),),
    CounterName.REQUESTS_FINISHED: (("vllm:request_success_total", None),),
    CounterName.PREEMPTIONS: (("vllm:num_preemptions_total", None),),
    CounterName.PREFIX_CACHE_QUERIES: (
        ("vllm:prefix_cache_queries_total", None),
        ("vllm:gpu_prefix_cache_queries_total", None),
    ),
    CounterName.PREFIX_CACHE_HITS: (
        ("vllm:prefix_cache_hits_total", None),
        ("vllm:gpu_prefix_cache_hits_total", None),
    ),
    CounterName.ADMISSION_REJECTIONS: (("vllm:admission_rejections_total", None),),
}

#: Histogram -> base names (``_bucket``/``_sum``/``_count`` appended), newest first.
HISTOGRAMS: Mapping[HistogramName, tuple[str, ...]] = {
    HistogramName.ITERATION_TOKENS: ("vllm:iteration_tokens_total",),
    HistogramName.INTER_TOKEN_LATENCY: (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    HistogramName.TTFT: ("vllm:time_to_first_token_seconds",),
    HistogramName.QUEUE_TIME: ("vllm:request_queue_time_seconds",),
    HistogramName.E2E: ("vllm:e2e_request_latency_seconds",),
    HistogramName.REQUEST_PROMPT_TOKENS: ("vllm:request_prompt_tokens",),
    HistogramName.REQUEST_GENERATION_TOKENS: ("vllm:request_generation_tokens",),
}

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
CACHE_CONFIG = "vllm:cache_config_info"


class VllmDialect:
    """The ``vllm`` dialect (V1 engine, and V0 up to ~0.10 through the old names)."""

    @property
    def name(self) -> str:
        return "vllm"

    @property
    def prefix(self) -> str:
        return PREFIX

    def read(self, samples: Samples) -> Reading:
        sources: dict[str, str] = {}
        counters = _counters(samples, sources)
        histograms = _histograms(samples, sources)
        gauges = _gauges(samples, sources)
        return Reading(
            gauges=gauges,
            counters=counters,
            histograms=histograms,
            model_names=samples.label_values("model_name", PREFIX),
            sources=sources,
        )


def _counters(samples: Samples, sources: dict[str, str]) -> dict[CounterName, float]:
    found: dict[CounterName, float] = {}
    for counter, aliases in COUNTERS.items():
        for name, where in aliases:
            value = samples.total(name, where)
            if value is not None:
                found[counter] = value
                sources[counter.value] = name
                break
    return found


def _histograms(samples: Samples, sources: dict[str, str]) -> dict[HistogramName, Histogram]:
    found: dict[HistogramName, Histogram] = {}
    for histogram, aliases in HISTOGRAMS.items():
        for base in aliases:
            value = samples.histogram(base)
            if value is not None:
                found[histogram] = value
                sources[histogram.value] = base
                break
    return found


def _gauges(samples: Samples, sources: dict[str, str]) -> Gauges:
    running = samples.total(RUNNING)
    waiting = samples.total(WAITING)
    if running is not None:
        sources["num_running"] = RUNNING
    if waiting is not None:
        sources["num_waiting"] = WAITING
    kv_name = samples.first_present(KV_USAGE)
    if kv_name is not None:
        sources["kv_cache_usage"] = kv_name
    capacity, block_size = _cache_config(samples)
    if capacity is not None or block_size is not None:
        sources["kv_capacity_tokens"] = CACHE_CONFIG
    return Gauges(
        num_running=_count(running),
        num_waiting=_count(waiting),
        kv_cache_usage=samples.mean(kv_name) if kv_name else None,
        kv_cache_usage_max=samples.max(kv_name) if kv_name else None,
        kv_capacity_tokens=capacity,
        block_size=block_size,
    )


def _count(value: float | None) -> int | None:
    return None if value is None else round(value)


def _cache_config(samples: Samples) -> tuple[int | None, int | None]:
    """(KV capacity in tokens over all engines, block size in tokens) from ``cache_config_info``.

    Capacity is ``None`` if any engine's capacity is unknown (a partial sum would understate it);
    block size is ``None`` unless every engine agrees.
    """
    series = samples.select(CACHE_CONFIG)
    if not series:
        return None, None
    capacities = [_capacity(labels) for labels, _ in series]
    block_sizes = {_int_label(labels.get("block_size")) for labels, _ in series}
    capacity = None if any(c is None for c in capacities) else sum(c for c in capacities if c is not None)
    block_size = block_sizes.pop() if len(block_sizes) == 1 else None
    return capacity, block_size


def _capacity(labels: Mapping[str, str]) -> int | None:
    """One engine's KV capacity in tokens: ``kv_cache_size_tokens``, else blocks x block size."""
    tokens = _int_label(labels.get("kv_cache_size_tokens"))
    if tokens is not None:
        return tokens
    blocks = _int_label(labels.get("num_gpu_blocks"))
    block_size = _int_label(labels.get("block_size"))
    return None if blocks is None or block_size is None else blocks * block_size


def _int_label(raw: str | None) -> int | None:
    """A label value such as ``"16"`` or ``"4294967296.0"`` as an int; ``None`` for ``"None"``/junk."""
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        value = float(raw)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None
