"""A continuous-batching engine in the image of vLLM V1's scheduler, driven by an injected clock.

No I/O, no asyncio, no wall clock: every method that needs the time takes ``now`` (seconds, any
monotonic origin). The driver loop is ``plan = schedule(now)`` (``None``: nothing to run), wait
``plan.duration_s``, then ``complete(plan, now)``; requests added meanwhile join the next step.
``add_request`` raises ``ValueError`` for a request that can never run (``validate_request``).
Scheduling follows ``vllm/v1/core/sched/scheduler.py``: decodes first, then FCFS prefill chunks
within ``max_num_batched_tokens`` and ``max_num_seqs``; when KV blocks run out the last running
request is preempted by recompute. With the profile's ``enable_prefix_caching`` (vLLM's default),
full blocks are cached by chained hash (``simulator.prefix_cache``) for requests added with their
token ids, and a new request's prefill starts after its longest cached prefix. The profile's
``api_server`` costs (``simulator.apiserver``; none by default) put the API server's tokenisation
and streaming work in front of the engine: a request then reaches WAITING only once tokenised,
and on a shared CPU that work lengthens steps.
The rules in full are in docs/emulator.md.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from simulator.apiserver import ApiServerQueue
from simulator.costmodel import StepShape, cost_model_for, jitter_factor
from simulator.prefix_cache import ROOT_HASH, BlockHash, BlockPool, BlockTable, block_hashes
from simulator.profile import Profile

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
    #: Prompt tokens the request found in the prefix cache (0 without prefix caching).
    cached_tokens: int = 0


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
    #: Prompt tokens found in the prefix cache when first scheduled (vLLM's ``num_cached_tokens``:
    #: usage's ``prompt_tokens_details.cached_tokens``); 0 without prefix caching.
    cached_tokens: int = 0
    #: Prompt tokens this request's prefill wrote into the prefix cache (vLLM's
    #: ``num_cache_creation_tokens``: usage's ``created_cache_tokens``); 0 without prefix caching.
    created_cache_tokens: int = 0


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
    #: Step duration in seconds: the API server's prelude (``api_server_s``) + the cost model's
    #: step time (jitter included).
    duration_s: float
    #: Requests preempted (by recompute) while building this step.
    preempted: tuple[str, ...] = ()
    #: When ``schedule`` built the step (the prelude, if any, starts then).
    started_at: float = 0.0
    #: Seconds at the start of ``duration_s`` before the engine computes: API-server work on the
    #: shared CPU, or (``separate``) the idle wait for a prompt to be tokenised. 0 without costs.
    api_server_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StepResult:
    events: list[TokenEvent]
    finished: list[FinishedRequestStats]
    #: Prompt tokens + tokens generated in this step, as vLLM's iteration_tokens_total counts them:
    #: a prompt counts whole, once, in the step that completes its prefill (not per chunk, not again
    #: after a preemption). The tokens actually computed are ``sum(plan.num_scheduled_tokens)``.
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
    # Counted when a request is admitted (first time only; never with prefix caching off).
    prefix_cache_queries: int = 0  # vllm:prefix_cache_queries_total (prompt tokens looked up)
    prefix_cache_hits: int = 0  # vllm:prefix_cache_hits_total (of those, tokens found cached)
    finished_by_reason: dict[str, int] = field(
        default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0}
    )


@dataclass(slots=True, eq=False)
class _Request:
    """Engine-side state of one request (vLLM's ``Request``, reduced to what is emulated)."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    #: The output length at which the emulated model samples EOS (<= max_tokens).
    output_tokens: int
    #: When it reached the engine (after the API server's tokenisation, if modelled): what vLLM's
    #: engine counts its request intervals from.
    arrival_s: float
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    #: The KV blocks it holds (cached ones by hash).
    table: BlockTable = field(default_factory=BlockTable)
    #: Prompt + output token ids so far; None: added without ids (never hits, never cached).
    token_ids: list[int] | None = None
    #: The id of output token ``i`` (0-based); None: output blocks are not hashed.
    output_token_id: Callable[[int], int] | None = None
    #: Chained hashes of the full blocks of ``token_ids``.
    block_hashes: list[BlockHash] = field(default_factory=list)
    #: Prompt tokens hit in the prefix cache at the first scheduling; -1 until then.
    num_cached_tokens: int = -1
    #: Prompt tokens its prefill added to the prefix cache (set at the first token).
    num_cache_created: int = 0
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished: bool = False

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens so far: what num_computed_tokens must catch up with."""
        return self.prompt_tokens + self.num_output_tokens


@dataclass(slots=True)
class _Emitted:
    """What one ``complete`` call produces, collected before the frozen ``StepResult`` is built."""

    events: list[TokenEvent] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    #: Prompt tokens of requests whose prefill completed (first time only).
    prompt_tokens: int = 0


class Engine:
    """Continuous batching with chunked prefill, paged KV blocks and preemption by recompute.

    See the module docstring for the call protocol. One step is in flight at a time: ``schedule``
    raises ``RuntimeError`` until the previous plan was passed to ``complete``. Not thread-safe.
    """

    def __init__(self, profile: Profile, *, seed: int | None = None, jitter: float = 0.0) -> None:
        if jitter < 0:
            raise ValueError(f"jitter must be >= 0 (relative standard deviation), got {jitter}")
        self.profile = profile
        self.jitter = jitter
        self.cost_model = cost_model_for(profile)
        # Separate streams, so how many output lengths the server draws never shifts the jitter.
        jitter_seed, sample_seed = np.random.SeedSequence(seed).spawn(2)
        self._jitter_rng = np.random.default_rng(jitter_seed)
        self._sample_rng = np.random.default_rng(sample_seed)
        self._limits = profile.engine
        self._blocks = BlockPool(
            profile.engine.num_gpu_blocks,
            profile.engine.block_size,
            enable_caching=profile.engine.enable_prefix_caching,
        )
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._in_flight: StepPlan | None = None
        self._in_flight_requests: dict[str, _Request] = {}
        #: The API server's work in front of the engine; None when the profile models none.
        self._api: ApiServerQueue | None = (
            ApiServerQueue(profile.api_server) if profile.api_server.enabled else None
        )
        self.stats = EngineCounters()

    # ----------------------------------------------------------------- introspection

    @property
    def num_running(self) -> int:
        """Requests in RUNNING (decoding or mid-prefill), as vllm:num_requests_running."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests in WAITING (new or preempted), as vllm:num_requests_waiting."""
        return len(self._waiting)

    @property
    def num_tokenising(self) -> int:
        """Requests added but still in the API server's tokenisation (not yet WAITING); 0 when
        the profile models no API-server costs."""
        return 0 if self._api is None else len(self._api)

    @property
    def kv_cache_usage(self) -> float:
        """Share of KV blocks in use, 0-1."""
        return self._blocks.usage

    @property
    def reserved_tokens(self) -> int:
        """Tokens the running requests could grow to: prompt + ``max_tokens`` of each (what TGI's
        ``tgi_batch_current_max_tokens`` reports: its queue admits against this reservation)."""
        return sum(r.prompt_tokens + r.max_tokens for r in self._running)

    @property
    def kv_tokens_in_use(self) -> int:
        """KV-cache slots held, in tokens: blocks in use x block size (SGLang ``num_used_tokens``)."""
        return (self._blocks.num_blocks - self._blocks.num_free) * self.profile.engine.block_size

    @property
    def num_free_blocks(self) -> int:
        """KV blocks not held by any request."""
        return self._blocks.num_free

    @property
    def prefix_cache(self) -> BlockPool:
        """The KV block pool and its prefix cache (read it; do not allocate from it)."""
        return self._blocks

    @property
    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    @property
    def in_flight(self) -> StepPlan | None:
        """The plan returned by ``schedule`` and not yet completed, if any."""
        return self._in_flight

    # ----------------------------------------------------------------- requests in and out

    def validate_request(self, prompt_tokens: int, max_tokens: int, output_tokens: int | None = None) -> None:
        """Raise ``ValueError`` (with the numbers) if such a request could never run to completion."""
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError(
                f"prompt_tokens and max_tokens must be >= 1, got {prompt_tokens} and {max_tokens}"
            )
        if output_tokens is not None and not 1 <= output_tokens <= max_tokens:
            raise ValueError(f"output_tokens must be in [1, max_tokens={max_tokens}], got {output_tokens}")
        limit = self._limits.max_model_len
        if prompt_tokens + max_tokens > limit:
            raise ValueError(
                f"prompt_tokens ({prompt_tokens}) + max_tokens ({max_tokens}) = {prompt_tokens + max_tokens} "
                f"exceeds max_model_len ({limit})"
            )
        # The last output token is sampled, never fed back, so its KV is never written.
        blocks = self._blocks.blocks_for(prompt_tokens + max_tokens - 1)
        if blocks > self._blocks.num_blocks:
            raise ValueError(
                f"a request of {prompt_tokens} + {max_tokens} tokens needs {blocks} KV blocks; "
                f"the cache has {self._blocks.num_blocks}"
            )

    def add_request(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        output_tokens: int,
        now: float,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        output_token_id: Callable[[int], int] | None = None,
    ) -> None:
        """Enqueue a request in WAITING (or, with API-server costs, in the API server's
        tokenisation first). ``ValueError`` if it can never fit, its id is live, or
        ``prompt_token_ids`` (what the prefix cache hashes; None: it neither hits nor is cached)
        are not ``prompt_tokens`` ids. ``output_token_id(i)``, the id of output token ``i``,
        lets full blocks of output be cached too."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        self.validate_request(prompt_tokens, max_tokens, output_tokens)
        req = _Request(request_id, prompt_tokens, max_tokens, output_tokens, arrival_s=now)
        if prompt_token_ids is not None:
            if len(prompt_token_ids) != prompt_tokens:
                raise ValueError(
                    f"prompt_token_ids has {len(prompt_token_ids)} ids for {prompt_tokens} prompt tokens"
                )
            req.token_ids = list(prompt_token_ids)
            req.output_token_id = output_token_id
            req.block_hashes = block_hashes(req.token_ids, self._blocks.block_size)
        self._requests[request_id] = req
        if self._api is None:
            self._waiting.append(req)
        else:
            self._api.admit(request_id, prompt_tokens, now)

    def abort_request(self, request_id: str, now: float) -> bool:
        """Remove a request wherever it is and free its blocks; False if unknown or finished.

        It is counted as finished with reason ``"abort"``; its stats are returned by no step (the
        caller records them from :meth:`abort_request_stats` if it needs them).
        """
        return self.abort_request_stats(request_id, now) is not None

    def abort_request_stats(self, request_id: str, now: float) -> FinishedRequestStats | None:
        """Like :meth:`abort_request`, returning the aborted request's stats (None if unknown)."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        if self._api is not None and self._api.drop(request_id):
            pass
        elif req in self._waiting:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
        return self._finish(req, "abort", now)

    def sample_output_tokens(self, max_tokens: int) -> int:
        """A seeded draw from the profile's output-length distribution, in [1, max_tokens]."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        dist = self.profile.output_lengths
        draw = self._sample_rng.lognormal(math.log(dist.median_tokens), dist.sigma)
        return min(max(1, round(float(draw))), max_tokens)

    # ----------------------------------------------------------------- one step

    def schedule(self, now: float) -> StepPlan | None:
        """Build the next step: RUNNING first, then WAITING FCFS; None when there is nothing to run."""
        if self._in_flight is not None:
            raise RuntimeError("a step is in flight: call complete(plan, now) before scheduling again")
        start = now if self._api is None else self._run_api_server(now)
        scheduled: dict[str, int] = {}
        preempted: list[str] = []
        budget = self._schedule_running(self._limits.max_num_batched_tokens, scheduled, preempted)
        # As vLLM: a step that had to preempt admits nobody new (blocks are short).
        if not preempted:
            self._schedule_waiting(budget, scheduled, start)
        if not scheduled:
            if self._api is not None:
                self._api.idle()
            return None
        plan = self._make_plan(scheduled, tuple(preempted), now, api_server_s=start - now)
        self._in_flight = plan
        self._in_flight_requests = {rid: self._requests[rid] for rid in scheduled}
        return plan

    def complete(self, plan: StepPlan, now: float) -> StepResult:
        """Apply ``plan`` at time ``now``: advance tokens, emit one token per caught-up request, finish."""
        if plan is not self._in_flight:
            raise RuntimeError("complete() got a plan that is not the step in flight")
        reqs, self._in_flight, self._in_flight_requests = self._in_flight_requests, None, {}
        out = _Emitted()
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            req = reqs[request_id]
            if req.finished:  # aborted while the step ran: its work is discarded
                continue
            req.num_computed_tokens += num_tokens
            if req.num_computed_tokens < req.num_tokens:  # a prefill chunk that is not the last
                continue
            if req.num_output_tokens == 0:
                out.prompt_tokens += req.prompt_tokens
            self._emit_token(req, now, out)
        if out.finished:
            self._running = [r for r in self._running if not r.finished]
        if self._api is not None:
            self._api.streamed(len(out.events), now)
        self.stats.prompt_tokens += out.prompt_tokens
        self.stats.generation_tokens += len(out.events)
        return StepResult(
            events=out.events,
            finished=out.finished,
            # vLLM counts a whole prompt in the step that completes its prefill (IterationStats).
            iteration_tokens=out.prompt_tokens + len(out.events),
            inter_token_latencies_s=out.itls,
            ttfts_s=out.ttfts,
        )

    # ----------------------------------------------------------------- scheduling helpers

    def _run_api_server(self, now: float) -> float:
        """Run the API server's prelude of a step built at ``now``: the requests it tokenised join
        WAITING, arriving when their tokenisation ended. Returns when the step's computation starts."""
        assert self._api is not None
        prelude = self._api.prelude(now, engine_busy=bool(self._running or self._waiting))
        for request_id, ready_s in prelude.ready:
            req = self._requests[request_id]
            req.arrival_s = ready_s
            self._waiting.append(req)
        return prelude.start_s

    def _schedule_running(self, budget: int, scheduled: dict[str, int], preempted: list[str]) -> int:
        """Give RUNNING requests their tokens in order; returns the budget left."""
        index = 0
        while index < len(self._running) and budget > 0:
            req = self._running[index]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, num_new, preempted):
                break
            scheduled[req.request_id] = num_new
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, req: _Request, num_new: int, preempted: list[str]) -> bool:
        """Find blocks for ``num_new`` more tokens of ``req``, preempting from the tail of RUNNING.

        False when ``req`` itself had to be preempted (vLLM's FCFS victim is the last running one).
        """
        while not self._blocks.allocate(req.table, req.num_computed_tokens + num_new):
            victim = self._running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        self._blocks.cache_blocks(req.table, req.block_hashes, req.num_computed_tokens + num_new)
        return True

    def _preempt(self, req: _Request) -> None:
        """Preemption by recompute: drop its KV, send it to the front of WAITING."""
        self._blocks.free(req.table)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self._waiting.appendleft(req)

    def _schedule_waiting(self, budget: int, scheduled: dict[str, int], now: float) -> int:
        """Admit WAITING requests FCFS while budget, max_num_seqs and blocks allow; returns budget left.

        A request's prefill starts after its longest cached prefix (never its last token); the
        lookup is counted in the prefix-cache counters when the request is admitted, the first
        time only, as vLLM records it.
        """
        while self._waiting and budget > 0 and len(self._running) < self._limits.max_num_seqs:
            req = self._waiting[0]
            hit = self._blocks.find_hit(req.block_hashes, req.num_tokens - 1)
            start = req.num_computed_tokens + len(hit) * self._blocks.block_size
            num_new = min(req.num_tokens - start, budget)
            if not self._blocks.allocate(req.table, start + num_new, hit):
                break
            self._waiting.popleft()
            self._running.append(req)
            req.num_computed_tokens = start
            self._blocks.cache_blocks(req.table, req.block_hashes, start + num_new)
            self._record_lookup(req, start)
            if req.first_scheduled_s is None:
                req.first_scheduled_s = now
            scheduled[req.request_id] = num_new
            budget -= num_new
        return budget

    def _record_lookup(self, req: _Request, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix-cache lookup (vLLM's ``PrefixCacheStats``): a
        request admitted again after a preemption is not counted, nor any with caching off."""
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_hit_tokens
            if self._blocks.enable_caching:
                self.stats.prefix_cache_queries += req.num_tokens
                self.stats.prefix_cache_hits += num_hit_tokens

    def _make_plan(
        self, scheduled: dict[str, int], preempted: tuple[str, ...], now: float, *, api_server_s: float
    ) -> StepPlan:
        """The step's composition and its duration: the API server's prelude, then the cost
        model's step time, jitter included (the jitter applies to the step alone)."""
        shape = self._shape(scheduled)
        duration = self.cost_model.step_time_s(shape) * jitter_factor(self._jitter_rng, self.jitter)
        return StepPlan(
            num_scheduled_tokens=scheduled,
            num_prefill_tokens=shape.num_prefill_tokens,
            num_decode_seqs=shape.num_decode_seqs,
            num_kv_tokens_read=shape.num_kv_tokens_read,
            duration_s=duration + api_server_s if api_server_s else duration,
            preempted=preempted,
            started_at=now,
            api_server_s=api_server_s,
        )

    def _shape(self, scheduled: dict[str, int]) -> StepShape:
        """Split the scheduled tokens into decodes (one token, everything before it cached) and chunks."""
        chunks: list[tuple[int, int]] = []
        decodes: list[int] = []
        for request_id, num_new in scheduled.items():
            req = self._requests[request_id]
            context = req.num_computed_tokens
            if num_new == 1 and req.num_output_tokens > 0 and context == req.num_tokens - 1:
                decodes.append(context + 1)
            else:
                chunks.append((num_new, context))
        return StepShape(prefill_chunks=tuple(chunks), decode_contexts=tuple(decodes))

    # ----------------------------------------------------------------- tokens and finishing

    def _emit_token(self, req: _Request, now: float, out: _Emitted) -> None:
        """One new output token for ``req`` at ``now``; finishes it on max_tokens or its EOS."""
        req.num_output_tokens += 1
        self._append_output_id(req)
        if req.first_token_s is None:
            req.first_token_s = now
            out.ttfts.append(now - req.arrival_s)
            created = min(req.table.cached_tokens_end(self._blocks.block_size), req.prompt_tokens)
            req.num_cache_created = max(0, created - max(req.num_cached_tokens, 0))
        else:
            assert req.last_token_s is not None
            out.itls.append(now - req.last_token_s)
        req.last_token_s = now
        reason = _finish_reason(req)
        cached = max(req.num_cached_tokens, 0)
        out.events.append(
            TokenEvent(req.request_id, 1, req.num_output_tokens, reason is not None, reason, cached)
        )
        if reason is not None:
            out.finished.append(self._finish(req, reason, now))

    def _append_output_id(self, req: _Request) -> None:
        """Extend ``req``'s token ids by its newest output token, hashing a block it fills."""
        if req.token_ids is None or req.output_token_id is None:
            return
        req.token_ids.append(req.output_token_id(req.num_output_tokens - 1))
        size = self._blocks.block_size
        if len(req.token_ids) % size == 0:
            parent = req.block_hashes[-1] if req.block_hashes else ROOT_HASH
            req.block_hashes.extend(
                block_hashes(req.token_ids, size, start=len(req.token_ids) - size, parent=parent)
            )

    def _finish(self, req: _Request, reason: FinishReason, now: float) -> FinishedRequestStats:
        """Free ``req``'s blocks, forget it, count it; the caller removes it from its queue."""
        self._blocks.free(req.table)
        req.finished = True
        del self._requests[req.request_id]
        self.stats.finished_by_reason[reason] += 1
        return _finished_stats(req, reason, now)


def _finish_reason(req: _Request) -> FinishReason | None:
    """Length is checked before EOS, as vLLM's ``check_stop`` does."""
    if req.num_output_tokens >= req.max_tokens:
        return "length"
    if req.num_output_tokens >= req.output_tokens:
        return "stop"
    return None


def _finished_stats(req: _Request, reason: FinishReason, now: float) -> FinishedRequestStats:
    """vLLM's per-request intervals; an interval whose end never happened (abort) is cut at ``now``."""
    scheduled = req.first_scheduled_s
    first, last = req.first_token_s, req.last_token_s
    decode_s = last - first if first is not None and last is not None else 0.0
    tokens = req.num_output_tokens
    return FinishedRequestStats(
        request_id=req.request_id,
        finish_reason=reason,
        prompt_tokens=req.prompt_tokens,
        generation_tokens=tokens,
        max_tokens=req.max_tokens,
        num_preemptions=req.num_preemptions,
        ttft_s=None if first is None else first - req.arrival_s,
        e2e_s=now - req.arrival_s,
        queue_s=(now if scheduled is None else scheduled) - req.arrival_s,
        inference_s=0.0 if scheduled is None else now - scheduled,
        prefill_s=0.0 if scheduled is None else (now if first is None else first) - scheduled,
        decode_s=decode_s,
        tpot_s=decode_s / (tokens - 1) if tokens >= 2 else None,
        cached_tokens=max(req.num_cached_tokens, 0),
        created_cache_tokens=req.num_cache_created,
    )
