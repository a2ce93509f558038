"""SGLang as the emulator shows it: ``/metrics`` and ``/get_server_info`` / ``/get_model_info``.

Metric families, types, labels and buckets are those of the public ~v0.4 docs scrape
(``tests/data/metrics/sglang-v0.4-docs-production_metrics.txt``, checked by
``tests/contract/test_engine_metrics_contract.py``), plus ``max_total_num_tokens``. As in SGLang:
token counters grow when a request finishes, ``time_per_output_token_seconds`` is a running mean
per request (not an inter-token latency), scheduler gauges update only on prefill steps and every
``decode_log_interval`` decode steps, and requests are never refused. Details: docs/emulator.md.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from simulator.engine import EngineCounters, FinishedRequestStats, StepPlan, StepResult

#: The SGLang release whose info endpoints this emulator imitates (``/get_server_info.version``).
SGLANG_VERSION: Final = "0.4.0"
#: SGLang's ``--decode-log-interval`` default: decode steps between two gauge updates.
DECODE_LOG_INTERVAL: Final = 40

# Buckets of the real ~v0.4 scrape.
TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 25.0, 30.0,
)  # fmt: skip
E2E_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
)  # fmt: skip
TPOT_BUCKETS: Final = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5,
)  # fmt: skip


class SglangEngineView(Protocol):
    """What the SGLang metrics read from the engine when SGLang would log its stats."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_tokens_in_use(self) -> int: ...

    @property
    def stats(self) -> EngineCounters: ...


class SglangMetrics:
    """One emulated SGLang server's metrics, in its own ``CollectorRegistry``."""

    def __init__(
        self,
        *,
        engine: SglangEngineView,
        model_name: str,
        kv_capacity_tokens: int,
        decode_log_interval: int = DECODE_LOG_INTERVAL,
    ) -> None:
        self.registry = CollectorRegistry()
        self._engine = engine
        self._capacity = kv_capacity_tokens
        self._interval = decode_log_interval
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames=labels, registry=r)

        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(model_name)
        self.token_usage = gauge("sglang:token_usage", "The token usage").labels(model_name)
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The cache hit rate").labels(model_name)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.tpot = Histogram(
            "sglang:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.num_running = gauge("sglang:num_running_reqs", "The number of running requests").labels(
            model_name
        )
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens").labels(model_name)
        self.gen_throughput = gauge("sglang:gen_throughput", "The generate throughput (token/s)").labels(
            model_name
        )
        self.num_queue = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue").labels(
            model_name
        )
        gauge("sglang:max_total_num_tokens", "Maximum total number of tokens").labels(model_name).set(
            kv_capacity_tokens
        )
        #: Decode tokens/s of the last log interval, as the ``gen_throughput`` gauge holds it.
        self.last_gen_throughput = 0.0
        #: Seconds since its first token and tokens after it, per request still generating.
        self._since_first: dict[str, tuple[float, int]] = {}
        self._decode_steps = 0
        self._decode_tokens = 0
        self._interval_started: float | None = None

    def record_request(self) -> None:
        """SGLang counts nothing when a request arrives."""

    def record_admitted(self, prompt_tokens: int, max_new_tokens: int, validation_s: float) -> None:
        """Nor when it is admitted."""

    def record_rejected(self, err: str) -> None:
        """SGLang never refuses a request here (no queue limit by default)."""

    def record_finished(self, stats: FinishedRequestStats) -> None:
        """A request finished (or was aborted): its tokens join the counters, its latency the e2e,
        and its e2e over its output tokens the TPOT histogram (~v0.4 ``handle_loop``)."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generation_tokens)
        self.e2e.observe(stats.e2e_s)
        if stats.generation_tokens >= 1:
            self.tpot.observe(stats.e2e_s / stats.generation_tokens)
        self._since_first.pop(stats.request_id, None)

    def record_step(self, result: StepResult, plan: StepPlan | None = None) -> None:
        """One engine step: latencies, finished requests, and the gauges when SGLang logs them."""
        for ttft in result.ttfts_s:
            self.ttft.observe(ttft)
        self._observe_tpot(result)
        for finished in result.finished:
            self.record_finished(finished)
        if plan is None:
            return
        if self._interval_started is None:
            self._interval_started = plan.started_at
        now = plan.started_at + plan.duration_s
        if plan.num_prefill_tokens > 0:
            self._log_stats()  # log_prefill_stats
            return
        self._decode_steps += 1
        self._decode_tokens += len(result.events)
        if self._decode_steps % self._interval == 0:
            elapsed = now - self._interval_started
            if elapsed > 0:
                self.last_gen_throughput = self._decode_tokens / elapsed
                self.gen_throughput.set(self.last_gen_throughput)
            self._decode_tokens = 0
            self._interval_started = now
            self._log_stats()  # log_decode_stats

    def _observe_tpot(self, result: StepResult) -> None:
        """Each token after a request's first: its mean time per output token so far.

        The engine lists one inter-token latency per such token, in the order of its events.
        """
        itls = iter(result.inter_token_latencies_s)
        for event in result.events:
            if event.num_output_tokens == event.num_new_tokens:  # its first token(s)
                self._since_first[event.request_id] = (0.0, 0)
                continue
            elapsed, after = self._since_first.get(event.request_id, (0.0, 0))
            elapsed, after = elapsed + next(itls, 0.0), after + event.num_new_tokens
            self._since_first[event.request_id] = (elapsed, after)
            self.tpot.observe(elapsed / after)

    def _log_stats(self) -> None:
        stats = self._engine.stats
        if stats.prefix_cache_queries:
            # ~v0.4 tree_cache_metrics: hit tokens over prompt tokens, cumulative, at prefill logs.
            self.cache_hit_rate.set(stats.prefix_cache_hits / stats.prefix_cache_queries)
        used = self._engine.kv_tokens_in_use
        self.num_running.set(self._engine.num_running)
        self.num_queue.set(self._engine.num_waiting)
        self.num_used_tokens.set(used)
        self.token_usage.set(round(used / self._capacity, 2) if self._capacity else 0.0)

    def sync_counters(self) -> None:
        """Nothing to sync: the counters grow as requests finish."""

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def server_info_body(
    *,
    model_path: str,
    served_model_name: str,
    max_running_requests: int,
    chunked_prefill_size: int,
    page_size: int,
    context_length: int,
    tp_size: int,
    kv_capacity_tokens: int,
    last_gen_throughput: float,
) -> dict[str, Any]:
    """``GET /get_server_info``: the ``ServerArgs`` fields the reference names, the scheduler's
    facts, ``internal_states`` and ``version`` (a real server dumps every ``ServerArgs`` field;
    the emulator lists the ones a router reads)."""
    return {
        "model_path": model_path,
        "tokenizer_path": model_path,
        "served_model_name": served_model_name,
        "context_length": context_length,
        "max_running_requests": max_running_requests,
        "max_queued_requests": None,
        "max_total_tokens": None,
        "chunked_prefill_size": chunked_prefill_size,
        "max_prefill_tokens": 16384,
        "schedule_policy": "fcfs",
        "page_size": page_size,
        "mem_fraction_static": 0.88,
        "tp_size": tp_size,
        "dp_size": 1,
        "enable_metrics": True,
        "decode_log_interval": DECODE_LOG_INTERVAL,
        "max_total_num_tokens": kv_capacity_tokens,
        "max_req_input_len": context_length - 1,
        "internal_states": [
            {
                "last_gen_throughput": last_gen_throughput,
                "memory_usage": {"kvcache": None, "token_capacity": kv_capacity_tokens},
                "effective_max_running_requests_per_dp": max_running_requests,
            }
        ],
        "version": SGLANG_VERSION,
    }


def model_info_body(model_path: str) -> dict[str, Any]:
    """``GET /get_model_info``."""
    return {
        "model_path": model_path,
        "tokenizer_path": model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
    }
