"""The emulated replica: the engine's stepping task, its in-flight requests and its metrics.

``Replica`` owns one ``simulator.engine.Engine``; the HTTP faces (``simulator.server``'s OpenAI
routes, ``simulator.native``'s engine-specific ones) submit validated ``GenerationRequest``s to it
and read each request's token events from its ``Inflight`` queue (``next_events``). It is found
on an emulator application at ``app[REPLICA]``. All of it runs on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from aiohttp import web

from simulator import sglang, tgi, tokens
from simulator.engine import Engine, FinishedRequestStats, StepPlan, StepResult, TokenEvent
from simulator.metrics import VllmMetrics, cache_config_labels
from simulator.profile import Profile

# The logger the emulator's replica lines have always used: log filters keep working.
log = logging.getLogger("simulator.server")

#: The vLLM release whose API and metric names this emulator reproduces (``GET /version``).
VLLM_VERSION: Final = "0.32.0"
#: How often in-flight requests are checked for a vanished client, in seconds.
DISCONNECT_POLL_S: Final = 0.05
#: What a dead engine answers, in vLLM's words (``EngineDeadError``).
ENGINE_DEAD_MESSAGE: Final = "EngineCore encountered an issue. See stack trace (above) for the root cause."
#: The engines the emulator can imitate (``--engine``).
EngineKind = Literal["vllm", "tgi", "sglang"]
ENGINES: Final[tuple[EngineKind, ...]] = ("vllm", "tgi", "sglang")


class ApiError(Exception):
    """A request vLLM would refuse; rendered by :func:`simulator.openai_errors.error_body` with ``status``."""

    def __init__(
        self, message: str, *, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completion or chat request, in tokens."""

    kind: Literal["completion", "chat"]
    #: Model name echoed in responses (the served name).
    model: str
    prompt_tokens: int
    #: Output cap after vLLM's defaulting and its clamp to ``max_model_len - prompt_tokens``
    #: (always >= 1); what vLLM's ``request_params_max_tokens`` histogram records.
    max_tokens: int
    ignore_eos: bool
    min_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage_stats: bool
    #: Seeds the fake output words, so the same prompt always gets the same text.
    text_seed: int
    #: The prompt's fake token ids (``simulator.tokens``), which the prefix cache hashes; None:
    #: the request neither hits nor fills the cache.
    prompt_token_ids: tuple[int, ...] | None = None


def random_id() -> str:
    """16 random hex digits: vLLM's ``random_uuid()``, the tail of its response and permission ids."""
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


def system_fingerprint(profile: Profile) -> str:
    """vLLM's default (``full``) fingerprint: ``vllm-<version>[-tp<N>]-<hash8>``.

    vLLM hashes its whole config; the emulator hashes the profile, so a replica's fingerprint
    changes exactly when what it emulates does (a profile without API-server costs hashes as it
    did before they could be modelled).
    """
    exclude = None if profile.api_server.enabled else {"api_server"}
    digest = hashlib.sha256(profile.model_dump_json(exclude=exclude).encode()).hexdigest()[:8]
    tp = f"-tp{profile.tensor_parallel}" if profile.tensor_parallel > 1 else ""
    return f"vllm-{VLLM_VERSION}{tp}-{digest}"


# ---------------------------------------------------------------------------------------------
# The replica: engine loop, in-flight requests, disconnect watcher
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Inflight:
    """One request between ``add_request`` and its last token (or abort)."""

    queue: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    #: The HTTP request whose connection is watched for a vanished client; None: not watched.
    connection: web.Request | None = None
    finished: bool = False
    num_output_tokens: int = 0
    #: The engine's account of the request once it finished (queue and inference times).
    stats: FinishedRequestStats | None = None

    def client_gone(self) -> bool:
        if self.connection is None:
            return False
        transport = self.connection.transport
        return transport is None or transport.is_closing()


class ReplicaMetrics(Protocol):
    """What every engine's ``/metrics`` implementation records (each ignores what its engine
    does not count): ``VllmMetrics``, ``tgi.TgiMetrics``, ``sglang.SglangMetrics``."""

    def record_request(self) -> None: ...

    def record_admitted(self, prompt_tokens: int, max_new_tokens: int, validation_s: float) -> None: ...

    def record_rejected(self, err: str) -> None: ...

    def record_step(self, result: StepResult, plan: StepPlan | None = None) -> None: ...

    def record_finished(self, stats: FinishedRequestStats) -> None: ...

    def sync_counters(self) -> None: ...

    def exposition(self) -> bytes: ...


class Replica:
    """One emulated replica: the engine, its stepping task, in-flight requests and metrics.

    ``engine_kind`` picks whose ``/metrics`` it exposes (vLLM, TGI, SGLang).
    ``max_concurrent_requests``: TGI's router limit (requests queued + running, ``None`` for the
    engines that have none); past it a request is refused at once (:meth:`try_acquire`).
    ``enable_prompt_tokens_details``: vLLM's flag of that name (cached tokens in usage).
    All methods run on the event loop; the engine is only touched from it, so no locking.
    """

    def __init__(
        self,
        profile: Profile,
        *,
        seed: int | None = None,
        jitter: float = 0.0,
        engine_kind: EngineKind = "vllm",
        max_concurrent_requests: int | None = None,
        enable_prompt_tokens_details: bool = False,
    ) -> None:
        self.profile = profile
        self.engine_kind: EngineKind = engine_kind
        #: vLLM's ``--enable-prompt-tokens-details``: usage carries ``prompt_tokens_details``.
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.engine = Engine(profile, seed=seed, jitter=jitter)
        self.model_name: str = profile.served_model_name
        self.max_model_len: int = profile.engine.max_model_len
        self.created = int(time.time())
        self.system_fingerprint = system_fingerprint(profile)
        if max_concurrent_requests is None and engine_kind == "tgi":
            max_concurrent_requests = tgi.DEFAULT_MAX_CONCURRENT_REQUESTS
        self.max_concurrent_requests = max_concurrent_requests
        self._permits_taken = 0
        self.metrics: ReplicaMetrics = _build_metrics(self)
        self.dead: BaseException | None = None
        #: Set at shutdown: in-flight requests were aborted because the server is stopping.
        self.stopping = False
        self._inflight: dict[str, Inflight] = {}
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the engine task and the disconnect watcher."""
        self._tasks = [
            asyncio.create_task(self._run_engine(), name=f"engine[{self.model_name}]"),
            asyncio.create_task(self._watch_disconnects(), name=f"disconnects[{self.model_name}]"),
        ]

    async def stop(self) -> None:
        """Abort everything in flight and stop the background tasks."""
        self.abort_all()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    @property
    def num_inflight(self) -> int:
        """Requests added to the engine and not yet finished (vLLM's ``/load`` server_load)."""
        return len(self._inflight)

    # ------------------------------------------------------------------ TGI's admission permits

    def try_acquire(self) -> bool:
        """Take one of ``max_concurrent_requests`` permits, at once or not at all (TGI's
        ``try_acquire``); always granted when there is no limit. Give it back with
        :meth:`release_permit` when the response has ended."""
        limit = self.max_concurrent_requests
        if limit is not None and self._permits_taken >= limit:
            return False
        self._permits_taken += 1
        return True

    def release_permit(self) -> None:
        self._permits_taken = max(0, self._permits_taken - 1)

    @property
    def permits_taken(self) -> int:
        """Requests holding a permit now (queued + running + still being answered)."""
        return self._permits_taken

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # ------------------------------------------------------------------ requests

    def submit(self, request_id: str, req: GenerationRequest, connection: web.Request | None) -> Inflight:
        """Add a validated request to the engine; its token events arrive on the returned queue."""
        refusal = abort_error(self)  # dead engine or shutting down
        if refusal is not None:
            raise refusal
        if req.ignore_eos:
            output_tokens = req.max_tokens
        else:
            output_tokens = max(req.min_tokens, self.engine.sample_output_tokens(req.max_tokens))
        seed = req.text_seed
        try:
            self.engine.add_request(
                request_id,
                req.prompt_tokens,
                req.max_tokens,
                output_tokens,
                self._now(),
                prompt_token_ids=req.prompt_token_ids,
                output_token_id=lambda index: tokens.fake_word_id(seed, index),
            )
        except ValueError as exc:
            # A request that fits max_model_len but can never fit the KV cache (tiny profiles).
            raise ApiError(str(exc)) from None
        entry = Inflight(connection=connection)
        self._inflight[request_id] = entry
        self._wakeup.set()
        return entry

    def release(self, request_id: str) -> None:
        """Forget a request whose handler is done; abort it first if it has not finished."""
        entry = self._inflight.get(request_id)
        if entry is not None and not entry.finished:
            self.abort(request_id)
        self._inflight.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request in the engine now (client gone) and wake its handler."""
        entry = self._inflight.get(request_id)
        if entry is None or entry.finished:
            return
        entry.finished = True
        stats = self.engine.abort_request_stats(request_id, self._now())
        if stats is not None:
            # vLLM records aborted requests like any finished one (request_success{abort}, e2e, ...).
            self.metrics.record_finished(stats)
            self.metrics.sync_counters()
        entry.queue.put_nowait(
            TokenEvent(
                request_id=request_id,
                num_new_tokens=0,
                num_output_tokens=entry.num_output_tokens,
                finished=True,
                finish_reason="abort",
            )
        )
        self._wakeup.set()

    def abort_all(self) -> None:
        """Abort every in-flight request (shutdown, dead engine)."""
        for request_id in list(self._inflight):
            self.abort(request_id)

    # ------------------------------------------------------------------ background tasks

    async def _run_engine(self) -> None:
        try:
            await self._step_forever()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # vLLM's EngineDeadError: /health turns 503 and every request in flight fails.
            log.exception("engine loop failed; the replica is now dead")
            self.dead = exc
            self.abort_all()

    async def _step_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            plan = self.engine.schedule(loop.time())
            if plan is None:
                # Nothing can run; add_request (or an abort) sets the event.
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if plan.duration_s > 0:
                await asyncio.sleep(plan.duration_s)
            result = self.engine.complete(plan, loop.time())
            for finished in result.finished:
                entry = self._inflight.get(finished.request_id)
                if entry is not None:
                    entry.stats = finished
            for event in result.events:
                self._dispatch(event)
            self.metrics.record_step(result, plan)

    def _dispatch(self, event: TokenEvent) -> None:
        entry = self._inflight.get(event.request_id)
        if entry is None or entry.finished:
            return  # aborted meanwhile, or its handler is gone
        entry.num_output_tokens = event.num_output_tokens
        entry.finished = event.finished
        entry.queue.put_nowait(event)

    async def _watch_disconnects(self) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            for request_id, entry in list(self._inflight.items()):
                if not entry.finished and entry.client_gone():
                    log.debug("client of %s disconnected; aborting", request_id)
                    self.abort(request_id)


def _build_metrics(replica: Replica) -> ReplicaMetrics:
    """The ``/metrics`` implementation of the replica's engine."""
    profile = replica.profile
    if replica.engine_kind == "tgi":
        return tgi.TgiMetrics(
            engine=replica.engine,
            max_input_tokens=replica.max_model_len - 1,
            max_total_tokens=replica.max_model_len,
            kv_capacity_tokens=profile.kv_cache_size_tokens,
        )
    if replica.engine_kind == "sglang":
        return sglang.SglangMetrics(
            engine=replica.engine,
            model_name=replica.model_name,
            kv_capacity_tokens=profile.kv_cache_size_tokens,
        )
    return VllmMetrics(
        engine=replica.engine,
        model_name=replica.model_name,
        max_model_len=replica.max_model_len,
        cache_config=_cache_config(profile),
    )


def _cache_config(profile: Profile) -> dict[str, str]:
    """``vllm:cache_config_info`` labels: vLLM 0.32's label set, the profile's cache facts filled in."""
    eng = profile.engine
    return cache_config_labels(
        block_size=eng.block_size,
        num_gpu_blocks=eng.num_gpu_blocks,
        max_model_len=eng.max_model_len,
        overrides=profile.cache_config_info(),
    )


REPLICA: Final = web.AppKey("replica", Replica)


async def next_events(entry: Inflight) -> list[TokenEvent]:
    """Wait for the next token event, then take any that queued up behind it.

    A slow reader gets the outputs of several steps merged into one chunk, as vLLM's output
    collector merges deltas the API server has not consumed yet.
    """
    events = [await entry.queue.get()]
    while not entry.queue.empty() and not events[-1].finished:
        events.append(entry.queue.get_nowait())
    return events


def abort_error(replica: Replica) -> ApiError | None:
    """What a client still connected is told when its request was aborted under it, if anything."""
    if replica.dead is not None:
        return ApiError(ENGINE_DEAD_MESSAGE, status=500, err_type="InternalServerError")
    if replica.stopping:
        return ApiError("The server is shutting down.", status=503, err_type="ServiceUnavailableError")
    return None  # the client itself left: nobody is listening
