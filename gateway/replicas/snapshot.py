"""What policies know about one replica at one instant: ``ReplicaSnapshot``, plus Sluice's own view.

A snapshot merges the replica's ``/metrics`` (gauges and windowed rates, lagging by up to one
scrape interval) with the gateway's own requests on it (``InFlight``, current). For every metric
field ``None`` means unknown (metric absent, no traffic in the window, fewer than two scrapes),
never a made-up ``0``; a ``0.0`` rate is a measured zero.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InFlight:
    """One request Sluice dispatched to a replica that has not finished yet (the gateway's view).

    ``prompt_tokens``: prompt length in tokens as the gateway counted or estimated it.
    ``tokens_streamed``: output tokens relayed to the client so far (0 before the first token).
    ``started_at``: monotonic seconds (the scraper's clock) when the request was dispatched.
    ``max_tokens``: the request's output cap in tokens; ``None`` when the client set none.
    ``last_token_at``: monotonic seconds when its latest output token was relayed; ``None`` before
    the first token or when not tracked. Tokens of all running requests land at the end of each
    engine step, so the newest of these tells the prediction where the engine's step cycle is.
    ``first_token_at``: monotonic seconds when its first output token was relayed (``None``: not
    yet, or not tracked): the end of the step that finished its prefill, so a prompt queued
    behind it got at most that step's leftover budget before then.
    ``cached_tokens``: prompt tokens the gateway expected to hit the replica's prefix cache
    (0 <= it < ``prompt_tokens``, or 0): its prefill starts past them.
    ``exact_output_tokens``: the output it will produce, when the client pinned it (``ignore_eos``
    with ``max_tokens``); ``None``: not known, then predicted.
    """

    request_id: str
    prompt_tokens: int
    tokens_streamed: int
    started_at: float
    max_tokens: int | None = None
    last_token_at: float | None = None
    first_token_at: float | None = None
    cached_tokens: int = 0
    exact_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """One replica's state as of ``taken_at`` (monotonic seconds of the scraper's clock).

    Freshness: ``stale`` is true when the scrape that produced this snapshot failed
    (``stale_reason`` says why, one line). A stale snapshot still carries the metric values of the
    last good scrape, taken at ``metrics_at`` (``None`` and all metrics ``None`` if there never was
    one); policies decide whether to trust them. ``in_flight`` is always current.

    Window: rates, means and quantiles cover the scrapes of the last ``window_s`` seconds that
    the scraper kept; ``window_s`` is the span actually covered (0.0 with fewer than two scrapes,
    so every windowed field is then ``None``). Rates are per second; latencies in seconds.
    """

    name: str
    taken_at: float
    stale: bool = False
    stale_reason: str | None = None
    #: The dialect that read the scrape (``"vllm"``, ``"tgi"``, ``"sglang"``); ``None`` when unknown
    #: (``backend: auto`` before the engine was detected).
    dialect: str | None = None
    #: Monotonic seconds of the scrape the metric fields come from; ``None`` if never scraped.
    metrics_at: float | None = None
    #: Seconds between the oldest and newest scrape in the window (0.0 with fewer than two).
    window_s: float = 0.0
    #: ``model_name`` label values seen in the scrape, sorted.
    model_names: tuple[str, ...] = ()

    # Gauges, read as is (summed over data-parallel engines for counts).
    #: Requests in the replica's running batch (vLLM ``num_requests_running``).
    num_running: int | None = None
    #: Requests in the replica's waiting queue.
    num_waiting: int | None = None
    #: KV-cache blocks in use, 0-1, mean over engines (= the replica's share when pools are equal).
    kv_cache_usage: float | None = None
    #: KV-cache use of the fullest engine, 0-1.
    kv_cache_usage_max: float | None = None
    #: KV-cache capacity in tokens, all engines together.
    kv_capacity_tokens: int | None = None
    #: KV block size in tokens.
    block_size: int | None = None

    # Counter rates over the window, per second.
    #: Prompt tokens per second as the replica counts them (cache hits included, vLLM).
    prompt_tokens_per_s: float | None = None
    #: Prompt tokens actually computed (prefix-cache hits excluded) per second.
    computed_prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    #: Engine steps per second: vLLM ``iteration_tokens_total`` count rate; TGI
    #: ``tgi_batch_forward_duration`` count rate; SGLang batch dispatches, or for old SGLang the
    #: estimate ``gen_throughput / num_running_reqs`` (decode steps only; ``sources`` says which).
    steps_per_s: float | None = None
    #: ``steps_per_s`` is an estimate of some steps only (old SGLang: decode steps, from
    #: ``gen_throughput / num_running_reqs``), not a count of every step: the window over it is
    #: no step period.
    steps_estimated: bool = False
    #: Requests finished per second, every finish reason (stop, length, abort, error...).
    requests_finished_per_s: float | None = None
    preemptions_per_s: float | None = None
    #: Requests the replica itself rejected per second (vLLM queue limits); ``None`` if not exposed.
    admission_rejections_per_s: float | None = None
    #: Prefix-cache hits / queries over the window, 0-1; ``None`` without queries.
    prefix_cache_hit_rate: float | None = None

    # Histogram statistics over the window (mean = d_sum / d_count; quantiles as PromQL).
    #: Tokens per engine step (prompt + generated of the step's outputs), mean.
    mean_tokens_per_step: float | None = None
    #: The window's increase of the tokens-per-step histogram as cumulative ``(le, count)`` pairs,
    #: ascending ``le`` (the last is ``inf`` in a complete histogram); empty when unknown. The
    #: step model needs the spread of step sizes, not only their mean (its cost has a knee).
    tokens_per_step_buckets: tuple[tuple[float, float], ...] = ()
    #: Inter-token latency in seconds (~ decode step time).
    itl_mean_s: float | None = None
    itl_p50_s: float | None = None
    itl_p90_s: float | None = None
    #: Time to first token in seconds, as the replica measures it (arrival to first token).
    ttft_mean_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    #: Seconds finished requests spent waiting in the replica's queue, mean.
    queue_time_mean_s: float | None = None
    #: End-to-end seconds of finished requests, mean.
    e2e_mean_s: float | None = None
    #: Prompt tokens per finished request, mean.
    mean_prompt_tokens_per_request: float | None = None
    #: Generated tokens per finished request, mean.
    mean_generation_tokens_per_request: float | None = None

    # Step time as the engine itself measures it (TGI, recent SGLang); ``None`` for engines that
    # do not (vLLM: its step time is inferred from ``steps_per_s`` and the ITL).
    #: Mean seconds of one engine step over the window, every kind of step (TGI
    #: ``tgi_batch_forward_duration``; SGLang busy seconds / batch dispatches).
    step_time_mean_s: float | None = None
    #: Mean seconds of one decode-only step (TGI ``method="decode"``).
    decode_step_time_mean_s: float | None = None
    #: Mean seconds of one step that prefills (TGI ``method="prefill"``).
    prefill_step_time_mean_s: float | None = None
    #: Mean over requests of the seconds of the step that prefilled them (the step their first
    #: token came from): the prefill steps weighted by the requests each started (TGI
    #: ``tgi_batch_next_size``; ``scrape.request_prefill_step_s``). Longer than the mean step
    #: when several requests share one, which then takes longer.
    request_prefill_step_time_mean_s: float | None = None
    #: Decode steps per second (TGI: count rate of ``method="decode"`` steps).
    decode_steps_per_s: float | None = None
    #: The engine's own smoothed decode throughput, tokens/s (SGLang ``gen_throughput``, updated
    #: every 40 decode steps); ``None`` where not exposed.
    engine_decode_tokens_per_s: float | None = None

    #: (canonical quantity, metric name read) for every quantity found: shows which alias was used.
    sources: tuple[tuple[str, str], ...] = ()

    #: The gateway's own unfinished requests on this replica at ``taken_at``.
    in_flight: tuple[InFlight, ...] = ()

    #: The same statistics over the newest scrape interval alone (its ``window_s`` is that
    #: interval; its ``in_flight`` is empty and it has no ``last_interval``); ``None`` with fewer
    #: than two scrapes in the window. Short, non-overlapping intervals vary in composition from
    #: one to the next, which is what lets a step-model fit tell its coefficients apart.
    last_interval: ReplicaSnapshot | None = None

    @property
    def gateway_in_flight(self) -> int:
        """Number of the gateway's unfinished requests on this replica."""
        return len(self.in_flight)

    @property
    def gateway_prompt_tokens_in_flight(self) -> int:
        """Prompt tokens of the gateway's unfinished requests, in tokens."""
        return sum(r.prompt_tokens for r in self.in_flight)

    @property
    def gateway_decode_tokens_so_far(self) -> int:
        """Output tokens streamed so far by the gateway's unfinished requests."""
        return sum(r.tokens_streamed for r in self.in_flight)

    def metrics_age_s(self, now: float) -> float | None:
        """Seconds since the scrape the metric fields come from; ``None`` if never scraped."""
        return None if self.metrics_at is None else now - self.metrics_at
