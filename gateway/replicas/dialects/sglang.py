"""SGLang's ``/metrics`` (``sglang:`` names; only served with ``--enable-metrics``).

Names and labels: ``shared/reference/backend-metrics.md`` §3 and the ~v0.4 docs scrape in
``tests/data/metrics/``. Series are kept at ``priority=""`` and the lowest ``tp_rank`` /
``pp_rank``, then summed over ``dp_rank`` (TP ranks are never added). KV usage is exact from
``num_used_tokens / max_total_num_tokens`` where exposed, else estimated (``sources`` says so);
``realtime_tokens_total`` is preferred to the end-of-request token counters; without dispatch
counters decode steps/s is an estimate marked ``steps_estimated``. Details: docs/engines.md.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.replicas.dialects.base import CounterName, Gauges, Histogram, HistogramName, Reading, Samples

PREFIX = "sglang:"

RUNNING = "sglang:num_running_reqs"
WAITING = "sglang:num_queue_reqs"
KV_USAGE = "sglang:token_usage"
USED_TOKENS = "sglang:num_used_tokens"
CAPACITY = "sglang:max_total_num_tokens"
PAGE_SIZE = "sglang:page_size"
GEN_THROUGHPUT = "sglang:gen_throughput"

#: ``token_usage`` at least this high gives a capacity estimate within ~5 % (it has 2 decimals).
_MIN_USAGE_FOR_ESTIMATE = 0.1
#: How far ``num_used_tokens / max_total_num_tokens`` may be from ``token_usage``, which is that
#: ratio rounded to two decimals (and set in the same ``log_stats`` call).
_ROUNDING_SLACK = 0.005 + 1e-9

#: Counter -> (sample name, extra label filter) aliases, newest first.
COUNTERS: Mapping[CounterName, tuple[tuple[str, Mapping[str, str] | None], ...]] = {
    CounterName.PROMPT_TOKENS: (("sglang:prompt_tokens_total", None),),
    CounterName.COMPUTED_PROMPT_TOKENS: (("sglang:realtime_tokens_total", {"mode": "prefill_compute"}),),
    CounterName.GENERATION_TOKENS: (
        ("sglang:realtime_tokens_total", {"mode": "decode"}),
        ("sglang:generation_tokens_total", None),
    ),
    CounterName.PREFIX_CACHE_HITS: (("sglang:cached_tokens_total", {"cache_source": "total"}),),
    CounterName.REQUESTS_FINISHED: (("sglang:num_requests_total", None),),
    CounterName.PREEMPTIONS: (("sglang:num_retracted_requests_total", None),),
    CounterName.STEPS: (("sglang:scheduler_loop_batch_dispatches_total", None),),
    CounterName.STEP_SECONDS: (("sglang:forward_execution_seconds_total", None),),
}

#: Histogram -> base names, newest first.
HISTOGRAMS: Mapping[HistogramName, tuple[str, ...]] = {
    HistogramName.TTFT: ("sglang:time_to_first_token_seconds",),
    HistogramName.INTER_TOKEN_LATENCY: (
        "sglang:inter_token_latency_seconds",
        "sglang:time_per_output_token_seconds",
    ),
    HistogramName.E2E: ("sglang:e2e_request_latency_seconds",),
    HistogramName.QUEUE_TIME: ("sglang:queue_time_seconds",),
    HistogramName.REQUEST_PROMPT_TOKENS: ("sglang:prompt_tokens_histogram",),
    HistogramName.REQUEST_GENERATION_TOKENS: ("sglang:generation_tokens_histogram",),
}


class SglangDialect:
    """The ``sglang`` dialect (~v0.4 names and labels up to the 2026 collector)."""

    @property
    def name(self) -> str:
        return "sglang"

    @property
    def prefix(self) -> str:
        return PREFIX

    def read(self, samples: Samples) -> Reading:
        sources: dict[str, str] = {}
        return Reading(
            gauges=_gauges(samples, sources),
            counters=_counters(samples, sources),
            histograms=_histograms(samples, sources),
            model_names=samples.label_values("model_name", PREFIX),
            sources=sources,
        )


def one_rank(samples: Samples, name: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The label filter that keeps one scheduler's view of ``name``: ``priority=""`` (the total
    over priorities), the lowest ``tp_rank`` and ``pp_rank`` present, plus ``extra``.

    Series without those labels (old versions, tokenizer metrics) match it unchanged.
    """
    where: dict[str, str] = {"priority": ""}
    series = samples.select(name, {**where, **(extra or {})})
    for label in ("tp_rank", "pp_rank"):
        values = {labels[label] for labels, _ in series if label in labels}
        if values:
            where[label] = min(values, key=_rank_key)
            series = [s for s in series if s[0].get(label) == where[label]]
    return {**where, **(extra or {})}


def _rank_key(value: str) -> tuple[int, str]:
    return (int(value), value) if value.isdigit() else (1 << 30, value)


def _counters(samples: Samples, sources: dict[str, str]) -> dict[CounterName, float]:
    found: dict[CounterName, float] = {}
    for counter, aliases in COUNTERS.items():
        for name, extra in aliases:
            value = samples.total(name, one_rank(samples, name, extra))
            if value is not None:
                found[counter] = value
                sources[counter.value] = name
                break
    return found


def _histograms(samples: Samples, sources: dict[str, str]) -> dict[HistogramName, Histogram]:
    found: dict[HistogramName, Histogram] = {}
    for histogram, aliases in HISTOGRAMS.items():
        for base in aliases:
            value = samples.histogram(base, one_rank(samples, base + "_count"))
            if value is not None:
                found[histogram] = value
                sources[histogram.value] = base
                break
    return found


def exact_usage(samples: Samples) -> tuple[float, float] | None:
    """(mean, max) KV usage over the DP ranks as ``num_used_tokens / max_total_num_tokens``, at
    full precision; ``None`` unless every rank has both and they agree with ``token_usage``.

    ``token_usage`` is rounded to two decimals (SGLang's ``log_stats``), a step of 1 % of the pool:
    4,483 tokens on an 8B model's 448k-token H100 pool, more than a handful of running requests
    hold, so the KV a step reads would come out as 0 or 4,483. The token count it is computed
    from is exact. A rank whose ratio does not round to its ``token_usage`` (a hybrid model's
    usage is the fullest of several pools) keeps the gauge.
    """
    ranks: dict[str, list[float | None]] = {}
    for position, name in enumerate((USED_TOKENS, CAPACITY, KV_USAGE)):
        for labels, value in samples.select(name, one_rank(samples, name)):
            ranks.setdefault(labels.get("dp_rank", ""), [None, None, None])[position] = value
    usages: list[float] = []
    for used, capacity, rounded in ranks.values():
        if used is None or capacity is None or rounded is None or capacity <= 0 or used < 0:
            return None
        usage = used / capacity
        if abs(usage - rounded) > _ROUNDING_SLACK:
            return None
        usages.append(usage)
    if not usages:
        return None
    return sum(usages) / len(usages), max(usages)


def _gauge(samples: Samples, name: str, sources: dict[str, str], key: str) -> float | None:
    value = samples.total(name, one_rank(samples, name))
    if value is not None:
        sources[key] = name
    return value


def _gauges(samples: Samples, sources: dict[str, str]) -> Gauges:
    running = _gauge(samples, RUNNING, sources, "num_running")
    waiting = _gauge(samples, WAITING, sources, "num_waiting")
    where = one_rank(samples, KV_USAGE)
    usage_mean = samples.mean(KV_USAGE, where)
    usage_max = samples.max(KV_USAGE, where)
    if usage_mean is not None:
        sources["kv_cache_usage"] = KV_USAGE
    capacity = _gauge(samples, CAPACITY, sources, "kv_capacity_tokens")
    if capacity is None:
        used = samples.total(USED_TOKENS, one_rank(samples, USED_TOKENS))
        if used is not None and usage_mean is not None and usage_mean >= _MIN_USAGE_FOR_ESTIMATE:
            capacity = used / usage_mean
            sources["kv_capacity_tokens"] = f"{USED_TOKENS} / {KV_USAGE} (estimate)"
    else:
        exact = exact_usage(samples)
        if exact is not None:
            usage_mean, usage_max = exact
            sources["kv_cache_usage"] = f"{USED_TOKENS} / {CAPACITY}"
    page = samples.max(PAGE_SIZE, one_rank(samples, PAGE_SIZE))
    if page is not None:
        sources["block_size"] = PAGE_SIZE
    throughput = _gauge(samples, GEN_THROUGHPUT, sources, "decode_tokens_per_s")
    return Gauges(
        num_running=None if running is None else round(running),
        num_waiting=None if waiting is None else round(waiting),
        kv_cache_usage=usage_mean,
        kv_cache_usage_max=usage_max,
        kv_capacity_tokens=None if capacity is None or capacity <= 0 else round(capacity),
        block_size=None if page is None or page <= 0 else round(page),
        decode_tokens_per_s=throughput,
    )
