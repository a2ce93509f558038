"""TGI's (text-generation-inference) ``/metrics``: the ``tgi_`` names of its router.

Names and labels: ``shared/reference/backend-metrics.md`` §2. No metric has a model label;
counters have no ``_total`` suffix, so each is looked up under both names (``Samples.counter``).
KV usage is the batch's reservation over ``tgi_batch_max_total_tokens``. Steps are timed directly
by kind from ``tgi_batch_inference_duration{method}`` (``_forward_duration`` as fallback).
``tgi_request_failure{err="overloaded"}`` counts the engine's own 429s. Details: docs/engines.md.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.replicas.dialects.base import CounterName, Gauges, Histogram, HistogramName, Reading, Samples

PREFIX = "tgi_"

RUNNING = "tgi_batch_current_size"
WAITING = "tgi_queue_size"
RESERVED_TOKENS = "tgi_batch_current_max_tokens"
CAPACITY = "tgi_batch_max_total_tokens"

REQUEST_SUCCESS = "tgi_request_success"
REQUEST_FAILURE = "tgi_request_failure"
#: ``err`` values of requests that entered the engine and then ended without success.
FAILED_AFTER_ADMISSION = ("generation", "incomplete", "dropped")

#: Counter -> (counter name without ``_total``, label filter) aliases, first found wins.
COUNTERS: Mapping[CounterName, tuple[tuple[str, Mapping[str, str] | None], ...]] = {
    CounterName.ADMISSION_REJECTIONS: ((REQUEST_FAILURE, {"err": "overloaded"}),),
    CounterName.STEPS: (("tgi_batch_inference_count", None),),
}

#: Counters read from a histogram's ``_sum`` (token totals): canonical -> histogram base.
SUM_COUNTERS: Mapping[CounterName, str] = {
    CounterName.PROMPT_TOKENS: "tgi_request_input_length",
    CounterName.GENERATION_TOKENS: "tgi_request_generated_tokens",
}

#: Histogram -> (base name, label filter) aliases, first found wins.
HISTOGRAMS: Mapping[HistogramName, tuple[tuple[str, Mapping[str, str] | None], ...]] = {
    # The step as the router runs it (forward + token decoding, filtering, concatenation): the
    # period tokens arrive at. The model's forward pass alone is the fallback.
    HistogramName.STEP_TIME: (("tgi_batch_inference_duration", None), ("tgi_batch_forward_duration", None)),
    HistogramName.DECODE_STEP_TIME: (
        ("tgi_batch_inference_duration", {"method": "decode"}),
        ("tgi_batch_forward_duration", {"method": "decode"}),
    ),
    HistogramName.PREFILL_STEP_TIME: (
        ("tgi_batch_inference_duration", {"method": "prefill"}),
        ("tgi_batch_forward_duration", {"method": "prefill"}),
    ),
    HistogramName.INTER_TOKEN_LATENCY: (
        ("tgi_batch_inference_duration", {"method": "decode"}),
        ("tgi_batch_forward_duration", {"method": "decode"}),
    ),
    HistogramName.PREFILL_BATCH_REQUESTS: (("tgi_batch_next_size", None),),
    HistogramName.QUEUE_TIME: (("tgi_request_queue_duration", None),),
    HistogramName.E2E: (("tgi_request_duration", None),),
    HistogramName.REQUEST_PROMPT_TOKENS: (("tgi_request_input_length", None),),
    HistogramName.REQUEST_GENERATION_TOKENS: (("tgi_request_generated_tokens", None),),
}


class TgiDialect:
    """The ``tgi`` dialect (TGI v2.3.1+ and v3; older versions lack the KV capacity gauge)."""

    @property
    def name(self) -> str:
        return "tgi"

    @property
    def prefix(self) -> str:
        return PREFIX

    def read(self, samples: Samples) -> Reading:
        sources: dict[str, str] = {}
        return Reading(
            gauges=_gauges(samples, sources),
            counters=_counters(samples, sources),
            histograms=_histograms(samples, sources),
            model_names=(),  # TGI's metrics carry no model label (``/info`` has ``model_id``)
            sources=sources,
        )


def _counters(samples: Samples, sources: dict[str, str]) -> dict[CounterName, float]:
    found: dict[CounterName, float] = {}
    for counter, aliases in COUNTERS.items():
        for name, where in aliases:
            hit = samples.counter(name, where)
            if hit is not None:
                sources[counter.value], found[counter] = hit
                break
    for counter, base in SUM_COUNTERS.items():
        value = samples.total(base + "_sum")
        if value is not None:
            found[counter] = value
            sources[counter.value] = base + "_sum"
    finished = _finished(samples)
    if finished is not None:
        found[CounterName.REQUESTS_FINISHED] = finished
        sources[CounterName.REQUESTS_FINISHED.value] = REQUEST_SUCCESS
    return found


def _finished(samples: Samples) -> float | None:
    """Requests that left the engine: successes plus failures after admission (not the 429s,
    validation or template errors, which never entered it). ``None`` without the success counter.
    """
    success = samples.counter(REQUEST_SUCCESS)
    if success is None:
        return None
    failed = [samples.counter(REQUEST_FAILURE, {"err": err}) for err in FAILED_AFTER_ADMISSION]
    return success[1] + sum(hit[1] for hit in failed if hit is not None)


def _histograms(samples: Samples, sources: dict[str, str]) -> dict[HistogramName, Histogram]:
    found: dict[HistogramName, Histogram] = {}
    for histogram, aliases in HISTOGRAMS.items():
        for base, where in aliases:
            value = samples.histogram(base, where)
            if value is not None:
                found[histogram] = value
                sources[histogram.value] = base + _selector(where)
                break
    return found


def _selector(where: Mapping[str, str] | None) -> str:
    return "" if not where else "{" + ",".join(f'{k}="{v}"' for k, v in sorted(where.items())) + "}"


def _gauges(samples: Samples, sources: dict[str, str]) -> Gauges:
    running = samples.total(RUNNING)
    waiting = samples.total(WAITING)
    reserved = samples.total(RESERVED_TOKENS)
    capacity = samples.total(CAPACITY)
    for key, name, value in (
        ("num_running", RUNNING, running),
        ("num_waiting", WAITING, waiting),
        ("kv_capacity_tokens", CAPACITY, capacity),
    ):
        if value is not None:
            sources[key] = name
    usage: float | None = None
    if reserved is not None and capacity is not None and capacity > 0:
        usage = min(max(reserved / capacity, 0.0), 1.0)
        sources["kv_cache_usage"] = f"{RESERVED_TOKENS} / {CAPACITY}"
    return Gauges(
        num_running=None if running is None else round(running),
        num_waiting=None if waiting is None else round(waiting),
        kv_cache_usage=usage,
        kv_cache_usage_max=usage,
        kv_capacity_tokens=None if capacity is None or capacity <= 0 else round(capacity),
        block_size=None,  # not exposed (16 on the paged-attention backends, per the reference)
    )
