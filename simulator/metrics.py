"""``/metrics`` of the emulated replica, with vLLM V1's exact metric names, types and labels.

A scrape must be indistinguishable from real vLLM 0.32 for everything the emulated engine knows
(checked by ``tests/contract/``): ``engine="0"`` and ``model_name`` labels, counters synced from
the engine's cumulative :class:`~simulator.engine.EngineCounters`, gauges read at scrape time,
vLLM's buckets. Families deliberately left out are listed in
``tests/contract/test_vllm_metrics_contract.py``. Each replica owns its own
:class:`~prometheus_client.CollectorRegistry`, so several can live in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from simulator.engine import EngineCounters, FinishedRequestStats, StepPlan, StepResult

#: Content type of the Prometheus text exposition format served on ``/metrics``.
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

#: ``finished_reason`` values vLLM 0.32 pre-creates (one series each, zeros included).
FINISHED_REASONS: Final = ("stop", "length", "abort", "error", "repetition")
#: ``source`` values of ``vllm:prompt_tokens_by_source_total``.
PROMPT_SOURCES: Final = ("local_compute", "local_cache_hit", "external_kv_transfer")
#: ``source`` values of ``vllm:prompt_tokens_cached_by_source_total``.
CACHED_SOURCES: Final = ("device", "host", "p2p", "disk", "external_unspecified")
#: ``sleep_state`` values of ``vllm:engine_sleep_state``.
SLEEP_STATES: Final = ("awake", "weights_offloaded", "discard_all")
#: ``reason`` values of ``vllm:num_requests_waiting_by_reason``.
WAITING_REASONS: Final = ("capacity", "deferred")

# vLLM V1 default buckets (vllm/v1/metrics/loggers.py; confirmed by the 0.32 scrape).
ITERATION_TOKENS_BUCKETS: Final = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
PARAMS_N_BUCKETS: Final = (1, 2, 5, 10, 20)
NUM_PREEMPTIONS_BUCKETS: Final = (1, 2, 3, 4, 5, 10, 20)

_BASE_LABELS: Final = ("engine", "model_name")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to and including ``max_value``.

    >>> build_1_2_5_buckets(1024)
    [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    """
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(value)
        scale *= 10


class EngineView(Protocol):
    """What the metrics layer reads from the engine at scrape time."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_cache_usage(self) -> float: ...

    @property
    def stats(self) -> EngineCounters: ...


class _EngineStateCollector(Collector):
    """Scheduler gauges, read from the engine at scrape time (vLLM sets them every step)."""

    def __init__(self, engine: EngineView, labels: Mapping[str, str]) -> None:
        self._engine = engine
        self._labels = dict(labels)

    def _family(self, name: str, documentation: str, extra: str | None = None) -> GaugeMetricFamily:
        names = sorted([*self._labels, *([extra] if extra else [])])
        return GaugeMetricFamily(name, documentation, labels=names)

    def _values(self, extra: Mapping[str, str] | None = None) -> list[str]:
        merged = {**self._labels, **(extra or {})}
        return [merged[k] for k in sorted(merged)]

    def collect(self) -> Iterator[Metric]:
        running = self._family("vllm:num_requests_running", "Number of requests in model execution batches.")
        running.add_metric(self._values(), float(self._engine.num_running))
        yield running

        waiting = self._family("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        waiting.add_metric(self._values(), float(self._engine.num_waiting))
        yield waiting

        by_reason = self._family(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, "
            "blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            "reason",
        )
        # The emulator has no LoRA budget or KV transfer: every waiting request waits for capacity.
        for reason in WAITING_REASONS:
            value = self._engine.num_waiting if reason == "capacity" else 0
            by_reason.add_metric(self._values({"reason": reason}), float(value))
        yield by_reason

        sleep = self._family(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            "sleep_state",
        )
        for state in SLEEP_STATES:
            sleep.add_metric(self._values({"sleep_state": state}), 1.0 if state == "awake" else 0.0)
        yield sleep

        usage = self._family("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        usage.add_metric(self._values(), float(self._engine.kv_cache_usage))
        yield usage


class _CacheConfigCollector(Collector):
    """``vllm:cache_config_info``: a gauge fixed at 1 whose labels are the cache config."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        self._names = sorted(labels)
        self._values = [labels[k] for k in self._names]

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=self._names
        )
        family.add_metric(self._values, 1.0)
        yield family


def cache_config_labels(
    *,
    block_size: int,
    num_gpu_blocks: int,
    max_model_len: int,
    engine_index: str = "0",
    overrides: Mapping[str, object] | None = None,
) -> dict[str, str]:
    """The label set of ``vllm:cache_config_info`` as vLLM 0.32 writes it (``str()`` of each field).

    Every label name of the real 0.32 scrape is present; values the emulator does not model take
    vLLM's defaults. ``kv_cache_size_tokens`` = ``num_gpu_blocks * block_size`` (no hybrid models
    here) and ``kv_cache_max_concurrency`` = that / ``max_model_len``, as vLLM computes them.
    ``overrides`` (for example ``cache_dtype``, ``gpu_memory_utilization``,
    ``enable_prefix_caching``, ``kv_cache_memory_bytes``) replace defaults, stringified.
    """
    size_tokens = num_gpu_blocks * block_size
    labels: dict[str, object] = {
        "_block_size_resolved": True,
        "block_size": block_size,
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": None,
        "effective_attention_block_size": block_size,
        "enable_mamba_shared_prefix_checkpoint": False,
        "enable_prefix_caching": False,
        "engine": engine_index,
        "gpu_memory_utilization": 0.9,
        "hash_block_size": None,
        "is_attention_free": False,
        "kv_cache_dtype_skip_layers": [],
        "kv_cache_layout": None,
        "kv_cache_max_concurrency": size_tokens / max_model_len,
        "kv_cache_memory_bytes": None,
        "kv_cache_size_tokens": size_tokens,
        "kv_offloading_backend": "native",
        "kv_offloading_size": None,
        "kv_sharing_fast_prefill": False,
        "mamba_block_size": None,
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": None,
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": None,
        "num_gpu_blocks": num_gpu_blocks,
        "num_gpu_blocks_override": None,
        "prefix_cache_retention_interval": 0,
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": None,
        "replayssm_buffer_len": 16,
        "skip_page_size_padded": None,
        "sliding_window": None,
        "swa_bounded_replay": True,
        "use_kda_recoverssm": False,
        "use_replayssm": False,
        "user_specified_block_size": False,
    }
    labels.update(overrides or {})
    return {name: str(value) for name, value in labels.items()}


class VllmMetrics:
    """Owns one replica's registry and every ``vllm:`` metric object in it.

    The engine loop calls :meth:`record_step` after each ``engine.complete`` and
    :meth:`sync_counters` after anything that changes the engine's counters (a step, an abort);
    :meth:`exposition` syncs once more and renders the text format.
    """

    def __init__(
        self,
        *,
        engine: EngineView,
        model_name: str,
        max_model_len: int,
        cache_config: Mapping[str, str],
        engine_index: str = "0",
        process_metrics: bool = True,
    ) -> None:
        self.registry = CollectorRegistry()
        self._engine = engine
        self._labels = {"engine": engine_index, "model_name": model_name}
        self._synced: dict[tuple[str, str], int] = {}
        if process_metrics:
            # The process/python families a real vLLM API server exposes alongside its own.
            GCCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            ProcessCollector(registry=self.registry)
        self.registry.register(_EngineStateCollector(engine, self._labels))
        self._build_counters()
        self._build_histograms(build_1_2_5_buckets(max_model_len))
        self.registry.register(_CacheConfigCollector(cache_config))
        self.sync_counters()

    # ------------------------------------------------------------------ construction

    def _counter(self, name: str, documentation: str, extra: str | None = None) -> Counter:
        names = sorted([*_BASE_LABELS, *([extra] if extra else [])])
        return Counter(name, documentation, labelnames=names, registry=self.registry)

    def _histogram(self, name: str, documentation: str, buckets: Iterable[float]) -> Histogram:
        return Histogram(
            name, documentation, labelnames=_BASE_LABELS, buckets=list(buckets), registry=self.registry
        )

    def _build_counters(self) -> None:
        lb = self._labels
        self.prefix_cache_queries = self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        ).labels(**lb)
        self.prefix_cache_hits = self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(**lb)
        self.num_preemptions = self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        ).labels(**lb)
        self.prompt_tokens = self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        ).labels(**lb)
        by_source = self._counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source"
        )
        self.prompt_tokens_by_source = {s: by_source.labels(source=s, **lb) for s in PROMPT_SOURCES}
        self.prompt_tokens_cached = self._counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ).labels(**lb)
        cached_by_source = self._counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
            "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            "source",
        )
        self.prompt_tokens_cached_by_source = {
            s: cached_by_source.labels(source=s, **lb) for s in CACHED_SOURCES
        }
        self.generation_tokens = self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(**lb)
        success = self._counter(
            "vllm:request_success", "Count of successfully processed requests.", "finished_reason"
        )
        self.request_success = {r: success.labels(finished_reason=r, **lb) for r in FINISHED_REASONS}

    def _build_histograms(self, token_buckets: list[int]) -> None:
        lb = self._labels
        h = self._histogram
        self.request_prompt_tokens = h(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        ).labels(**lb)
        self.request_generation_tokens = h(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        ).labels(**lb)
        self.iteration_tokens = h(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        ).labels(**lb)
        self.request_max_num_generation_tokens = h(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        ).labels(**lb)
        self.request_params_n = h(
            "vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS
        ).labels(**lb)
        self.request_params_max_tokens = h(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        ).labels(**lb)
        self.time_to_first_token = h(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        ).labels(**lb)
        self.inter_token_latency = h(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        ).labels(**lb)
        self.request_time_per_output_token = h(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        ).labels(**lb)
        self.e2e_request_latency = h(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**lb)
        self.request_queue_time = h(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**lb)
        self.request_inference_time = h(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**lb)
        self.request_prefill_time = h(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**lb)
        self.request_decode_time = h(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**lb)
        self.request_num_preemptions = h(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            NUM_PREEMPTIONS_BUCKETS,
        ).labels(**lb)
        self.request_prefill_kv_computed_tokens = h(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        ).labels(**lb)

    # ------------------------------------------------------------------ recording

    def _advance(self, key: tuple[str, str], child: Counter, total: int) -> None:
        """Increase ``child`` to the engine's cumulative ``total`` (counters never go back)."""
        delta = total - self._synced.get(key, 0)
        if delta > 0:
            child.inc(delta)
            self._synced[key] = total

    def sync_counters(self) -> None:
        """Bring every counter up to the engine's cumulative :class:`EngineCounters`."""
        s = self._engine.stats
        hits = s.prefix_cache_hits
        self._advance(("prompt_tokens", ""), self.prompt_tokens, s.prompt_tokens)
        self._advance(("generation_tokens", ""), self.generation_tokens, s.generation_tokens)
        self._advance(("num_preemptions", ""), self.num_preemptions, s.preemptions)
        self._advance(("prefix_cache_queries", ""), self.prefix_cache_queries, s.prefix_cache_queries)
        self._advance(("prefix_cache_hits", ""), self.prefix_cache_hits, hits)
        self._advance(("prompt_tokens_cached", ""), self.prompt_tokens_cached, hits)
        computed = max(0, s.prompt_tokens - hits)
        by_source = self.prompt_tokens_by_source
        self._advance(("by_source", "local_compute"), by_source["local_compute"], computed)
        self._advance(("by_source", "local_cache_hit"), by_source["local_cache_hit"], hits)
        self._advance(("cached_by_source", "device"), self.prompt_tokens_cached_by_source["device"], hits)
        for reason, child in self.request_success.items():
            self._advance(("request_success", reason), child, s.finished_by_reason.get(reason, 0))

    def record_finished(self, stats: FinishedRequestStats) -> None:
        """Observe one finished request into the per-request histograms (``n`` is always 1)."""
        self.request_prompt_tokens.observe(stats.prompt_tokens)
        self.request_generation_tokens.observe(stats.generation_tokens)
        self.request_max_num_generation_tokens.observe(stats.generation_tokens)
        self.request_params_n.observe(1)
        self.request_params_max_tokens.observe(stats.max_tokens)
        self.request_num_preemptions.observe(stats.num_preemptions)
        # Prefill computes the KV of the prompt less what the prefix cache had.
        self.request_prefill_kv_computed_tokens.observe(stats.prompt_tokens - stats.cached_tokens)
        self.e2e_request_latency.observe(stats.e2e_s)
        self.request_queue_time.observe(stats.queue_s)
        self.request_inference_time.observe(stats.inference_s)
        self.request_prefill_time.observe(stats.prefill_s)
        self.request_decode_time.observe(stats.decode_s)
        if stats.tpot_s is not None:
            self.request_time_per_output_token.observe(stats.tpot_s)

    def record_request(self) -> None:
        """vLLM counts nothing when a request arrives (its counters move at steps and finishes)."""

    def record_admitted(self, prompt_tokens: int, max_new_tokens: int, validation_s: float) -> None:
        """Nor when the request enters the engine."""

    def record_rejected(self, err: str) -> None:
        """vLLM refuses nothing by default (no queue limits are emulated)."""

    def record_step(self, result: StepResult, plan: StepPlan | None = None) -> None:
        """Observe one completed engine step: per-step histograms, finished requests, counters.

        ``plan`` is accepted for the engines that time steps (TGI); vLLM's metrics do not need it.
        """
        self.iteration_tokens.observe(result.iteration_tokens)
        for ttft in result.ttfts_s:
            self.time_to_first_token.observe(ttft)
        for itl in result.inter_token_latencies_s:
            self.inter_token_latency.observe(itl)
        for finished in result.finished:
            self.record_finished(finished)
        self.sync_counters()

    def exposition(self) -> bytes:
        """The full ``/metrics`` body in the Prometheus text format, counters synced first."""
        self.sync_counters()
        return generate_latest(self.registry)
