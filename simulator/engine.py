"""A continuous-batching engine in the image of vLLM V1's scheduler, driven by an injected clock.

INTERFACE CONTRACT (the HTTP server in ``simulator/server.py`` and the later virtual-time replay
depend on exactly these names; bodies are filled in by the engine work):

* ``Engine(profile, *, seed=None, jitter=0.0)``: no I/O, no asyncio, no wall clock. Every method
  that needs the time takes ``now`` (seconds, any monotonic origin) from the caller.
* ``add_request(request_id, prompt_tokens, max_tokens, output_tokens, now)``: enqueue in WAITING.
  ``output_tokens`` is when the emulated model "samples EOS" (``<= max_tokens``); the request
  finishes with reason ``"stop"`` there, or ``"length"`` when it reaches ``max_tokens``.
* ``abort_request(request_id, now) -> bool``: remove it wherever it is, free its KV blocks, count
  it as finished with reason ``"abort"``. False if unknown or already finished.
* ``schedule(now) -> StepPlan | None``: build the next step (decodes of RUNNING first, then
  prefill chunks of WAITING, within ``max_num_batched_tokens`` and ``max_num_seqs``; allocate KV
  blocks, preempting by recompute when they run out) and return it with its duration from the
  cost model; ``None`` when there is nothing to run. The caller waits ``plan.duration_s`` and then
  calls ``complete``. Requests added meanwhile join the next step, as in vLLM.
* ``complete(plan, now) -> StepResult``: apply the step: advance computed tokens, emit one token
  to every sequence that decoded or finished its prefill this step, finish requests; return the
  token events and the statistics the metrics layer needs.
* Introspection for ``/metrics``: ``num_running``, ``num_waiting``, ``kv_cache_usage`` (0–1),
  ``stats`` (cumulative ``EngineCounters``), ``profile``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Tokens a request received at the end of one step (normally exactly one)."""

    request_id: str
    #: New output tokens in this event (1 per step for a decoding sequence).
    num_new_tokens: int
    #: Total output tokens of the request so far, including these.
    num_output_tokens: int
    finished: bool
    finish_reason: FinishReason | None


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """Everything vLLM observes into its per-request histograms, in seconds and tokens."""

    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int
    num_preemptions: int
    #: arrival -> first token; None when aborted before the first token.
    ttft_s: float | None
    e2e_s: float
    #: time spent WAITING before first scheduled (vLLM's request_queue_time_seconds).
    queue_s: float
    #: first scheduled -> finished (request_inference_time_seconds).
    inference_s: float
    #: first scheduled -> first token (request_prefill_time_seconds).
    prefill_s: float
    #: first token -> last token (request_decode_time_seconds).
    decode_s: float
    #: mean time per output token after the first; None with fewer than 2 tokens.
    tpot_s: float | None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One scheduled engine step."""

    #: request_id -> tokens computed for it in this step (vLLM's ``num_scheduled_tokens``).
    num_scheduled_tokens: dict[str, int]
    #: Prompt tokens computed in this step (prefill chunks).
    num_prefill_tokens: int
    #: Sequences that decode one token in this step.
    num_decode_seqs: int
    #: KV-cache tokens read by the attention of this step (context of every scheduled sequence).
    num_kv_tokens_read: int
    #: Step duration from the cost model (jitter included), in seconds.
    duration_s: float
    #: Requests preempted (by recompute) while building this step.
    preempted: tuple[str, ...] = ()
    started_at: float = 0.0


@dataclass(frozen=True, slots=True)
class StepResult:
    events: list[TokenEvent]
    finished: list[FinishedRequestStats]
    #: Prompt tokens computed + tokens generated in this step (vLLM's iteration_tokens_total).
    iteration_tokens: int
    #: Inter-token latencies observed in this step, one per decoding request, in seconds.
    inter_token_latencies_s: list[float]
    #: Time-to-first-token of requests that got their first token in this step, in seconds.
    ttfts_s: list[float]


@dataclass(slots=True)
class EngineCounters:
    """Cumulative counters (vLLM counter names in comments)."""

    prompt_tokens: int = 0  # vllm:prompt_tokens_total (full prompt, when prefill completes)
    generation_tokens: int = 0  # vllm:generation_tokens_total
    preemptions: int = 0  # vllm:num_preemptions_total
    prefix_cache_queries: int = 0  # vllm:prefix_cache_queries_total (tokens)
    prefix_cache_hits: int = 0  # vllm:prefix_cache_hits_total (no prefix caching modelled: 0)
    finished_by_reason: dict[str, int] = field(
        default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0}
    )
