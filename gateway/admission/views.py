"""One replica as the admitter sees it: health, step model, load, and the streams it must protect.

A view holds facts only (no class targets), so a settings reload never leaves views that judge
by the old targets: the admitter reads targets from the settings in force at each decision.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Generic, Protocol, TypeVar

from gateway.admission.request import AdmissionRequest
from gateway.admission.shares import EMPTY_LOAD, ClassLoad, StreamingRequest, class_loads, decode_elapsed_s
from predictor import Forecast, ReplicaState, StepBatch, StepModel
from predictor.correction import NO_CORRECTION, Correction
from predictor.forecast_inputs import slots_after_one_more
from predictor.prefix_index import PrefixIndex, expected_hit_tokens

__all__ = ["LiveEntry", "ReplicaView", "TrackedStream", "current_step_s", "overdue_s", "with_queued"]

#: No class has a margin of its own (every class: ``admission.forecast_margin``).
NO_MARGINS: Final[Mapping[str, float]] = MappingProxyType({})

_Frozen_co = TypeVar("_Frozen_co", covariant=True)
_Frozen = TypeVar("_Frozen")


class LiveEntry(Protocol[_Frozen_co]):
    """A dispatched request's mutable in-flight entry (``gateway.replicas.registry.LiveRequest``):
    prompt tokens (an estimate until usage arrives), tokens streamed so far, when the first and
    the latest were relayed (monotonic seconds, ``None`` before the first), and its immutable
    snapshot. ``cached_tokens``: prompt tokens expected to hit the replica's prefix cache, set by
    admission when it sends the request."""

    cached_tokens: int

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def tokens_streamed(self) -> int: ...

    @property
    def first_token_at(self) -> float | None: ...

    @property
    def last_token_at(self) -> float | None: ...

    @property
    def started_at(self) -> float: ...

    @property
    def max_tokens(self) -> int | None: ...

    @property
    def streamed(self) -> bool: ...

    def freeze(self, tokens_streamed: int | None = None) -> _Frozen_co: ...


class TrackedStream(Generic[_Frozen]):
    """One request admission sent to a replica: its live entry, what admission predicted for it,
    and the immutable forms a view is built from, kept until the entry changes.

    ``request_class``: the class it was admitted as. ``expected_output_tokens``: its predicted
    output (tokens). ``predicted_tpot_s``: its forecast TPOT at dispatch (seconds).
    ``predicted_ttft_s``: its forecast TTFT at dispatch (seconds; NaN: none).

    A view rebuild needs every stream on the replica twice: frozen (``live.freeze()``, for the
    prediction service's state) and as a ``StreamingRequest`` (for the class loads). Both are
    immutable objects that change only when the entry does (a streamed token, the real prompt
    size), so ``in_flight()`` and ``streaming()`` return the objects built last time unless the
    fields they copy changed: exactly what a fresh build would return, without allocating two
    objects per stream per rebuild (the rebuilds run on every decision: docs/benchmarks.md,
    'Proxy overhead', profiles their share of a request's CPU).

    **A request whose tokens are not seen** (``live.streamed`` False: a non-streamed response
    arrives whole at its end) would otherwise look like a prompt still waiting for its prefill
    however long it has run, and every newcomer's forecast would queue behind all of them. Its
    progress at ``now`` is estimated from its own forecast instead (``tokens_at``): no token
    before its predicted TTFT, then one per predicted TPOT, below its output cap.
    """

    __slots__ = (
        "_frozen",
        "_frozen_key",
        "_streaming",
        "expected_output_tokens",
        "live",
        "predicted_tpot_s",
        "predicted_ttft_s",
        "request_class",
    )

    def __init__(
        self,
        live: LiveEntry[_Frozen],
        request_class: str,
        expected_output_tokens: float,
        predicted_tpot_s: float,
        predicted_ttft_s: float = math.nan,
    ) -> None:
        self.live = live
        self.request_class = request_class
        self.expected_output_tokens = expected_output_tokens
        self.predicted_tpot_s = predicted_tpot_s
        self.predicted_ttft_s = predicted_ttft_s
        self._frozen: _Frozen | None = None
        self._frozen_key: tuple[int, int, float | None] | None = None
        self._streaming: StreamingRequest | None = None

    def tokens_at(self, now: float | None) -> int:
        """Output tokens the request has produced by ``now`` (monotonic seconds), as far as the
        gateway can tell: those relayed for a stream; for a request whose tokens are not seen,
        the estimate from its forecast (0 until ``started_at + predicted_ttft_s``, then one more
        per ``predicted_tpot_s``, at most ``max_tokens - 1``: it has not finished). ``now``
        ``None``, or no forecast: the count relayed."""
        live = self.live
        if live.streamed or now is None or live.tokens_streamed:
            return live.tokens_streamed
        since_first = now - live.started_at - self.predicted_ttft_s
        if not since_first >= 0.0:  # before its first token, or no forecast (NaN)
            return 0
        tpot = self.predicted_tpot_s
        tokens = 1 + int(since_first / tpot) if tpot > 0.0 else 1
        cap = live.max_tokens
        if cap is not None and tokens > cap - 1:
            tokens = max(0, cap - 1)
        return tokens

    def in_flight(self, now: float | None = None) -> _Frozen:
        """``live.freeze()`` as of ``now`` (``tokens_at``; the same object while prompt, tokens
        and the latest token's time are unchanged; the entry's other fields never change)."""
        live = self.live
        tokens = self.tokens_at(now)
        key = (live.prompt_tokens, tokens, live.last_token_at)
        if self._frozen is None or key != self._frozen_key:
            self._frozen = live.freeze(tokens)
            self._frozen_key = key
        return self._frozen

    def streaming(self, now: float | None = None) -> StreamingRequest:
        """The stream as the class loads count it, as of ``now`` (``tokens_at``);
        ``decode_elapsed_s`` is the time from its first relayed token to its latest
        (``shares.decode_elapsed_s``), what the stall budget reckons a stream has already taken
        (``None`` for a request whose tokens are not seen: its tokens at its predicted TPOT)."""
        live = self.live
        s = self._streaming
        tokens = self.tokens_at(now)
        elapsed: float | None = decode_elapsed_s(live.first_token_at, live.last_token_at)
        if not live.streamed and not live.tokens_streamed:
            elapsed = None
        if (
            s is None
            or s.generated_tokens != tokens
            or s.prompt_tokens != live.prompt_tokens
            or s.decode_elapsed_s != elapsed
        ):
            s = self._streaming = StreamingRequest(
                self.request_class,
                live.prompt_tokens,
                tokens,
                self.expected_output_tokens,
                self.predicted_tpot_s,
                elapsed,
            )
        return s


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """A replica at one instant, ready for admission checks (build with ``ReplicaView.build``).

    ``healthy``: False means never route here. ``stale``: its metrics are older than trusted; the
    ``state`` should then come from the gateway's own in-flight accounting
    (``ReplicaState.from_sequences``) and predictions get ``admission.stale_margin`` added.
    ``model``: the replica's current step model (the last fitted one when stale).
    ``loads``: the gateway's streams there, per class name (as the streams named it).
    ``extra_tpot_s``: TPOT added to every stream by requests admitted since the view was built
    (``with_admitted``): a stream's TPOT is its load's figure plus this.
    ``gateway_streams``: the gateway's unfinished requests there.
    ``built_at``: the instant (the admitter's clock, seconds) the state describes: its
    ``step_remaining_s`` counts from then. A view may be used after it, until the step in progress
    is predicted to end (``usable_until``): nothing about the replica changes in between but the
    step's phase, which ``step_elapsed_s`` gives. NaN: timeless (used as built).
    ``dispatch_overhead_s``: seconds a request's first token takes beyond the engine's forecast
    there (the HTTP hop and the replica server's own work, learned from its TTFTs: the live
    gateway's ``PredictionService``); admission adds it to every TTFT it holds against a deadline.
    0 where nothing is learned (virtual time).
    ``correction``: the factors admission multiplies the engine's TTFT and TPOT forecasts by there,
    per load regime, learned from what the gateway measured (``predictor.correction``; every
    factor 1 when nothing is learned).
    ``margins``: per class name, the margin (a fraction) admission applies to that class's
    forecasts here in place of ``admission.forecast_margin``, held by the attainment controller
    (``gateway.admission.attainment``); a class absent has ``forecast_margin``.
    ``prefix``: what the replica's prefix cache probably holds (``predictor.prefix_index``; a live
    index, shared with the engine, so a dispatch made after the view was built counts); ``None``:
    prefix caching not modelled there. ``prefix_realized``: the share of expected hits the
    replica has been delivering, in [0, 1].
    ``overdue_s``: how long past the TTFT admission held it to the most overdue of the gateway's
    requests still waiting there for their first token already waits (seconds, ``overdue_s``;
    0 when none is late): admission adds it to a newcomer's TTFT, since the queue it would join
    runs that far behind its forecasts now.
    """

    name: str
    healthy: bool
    model: StepModel
    state: ReplicaState
    stale: bool
    loads: Mapping[str, ClassLoad]
    gateway_streams: int
    extra_tpot_s: float = 0.0
    built_at: float = math.nan
    dispatch_overhead_s: float = 0.0
    correction: Correction = NO_CORRECTION
    margins: Mapping[str, float] = dataclasses.field(default_factory=lambda: NO_MARGINS)
    prefix: PrefixIndex | None = None
    prefix_realized: float = 1.0
    overdue_s: float = 0.0

    def cached_tokens(self, request: AdmissionRequest) -> int:
        """Prompt tokens of ``request`` expected to hit this replica's prefix cache (0 <= it <
        its prompt tokens): its indexed blocks found here, else its own ``cached_prompt_tokens``."""
        if request.prefix is None or self.prefix is None:
            return request.cached_prompt_tokens
        hit = expected_hit_tokens(request.prefix, self.prefix, request.prompt_tokens, self.prefix_realized)
        return max(hit, request.cached_prompt_tokens)

    @classmethod
    def build(
        cls,
        name: str,
        *,
        healthy: bool,
        model: StepModel,
        state: ReplicaState,
        streams: Iterable[StreamingRequest] = (),
        stale: bool = False,
        built_at: float = math.nan,
        dispatch_overhead_s: float = 0.0,
        correction: Correction = NO_CORRECTION,
        margins: Mapping[str, float] = NO_MARGINS,
        prefix: PrefixIndex | None = None,
        prefix_realized: float = 1.0,
        overdue_s: float = 0.0,
    ) -> ReplicaView:
        """Aggregate ``streams`` (the gateway's requests running there) once: O(k log k).

        ``stale`` or ``state.stale`` marks the view stale. Each stream's TPOT is floored at the
        replica's current decode step time (``current_step_s``). ``built_at``,
        ``dispatch_overhead_s``, ``correction``, ``margins``, ``prefix``, ``prefix_realized``,
        ``overdue_s``: see the class.
        """
        items = list(streams)
        loads = class_loads(items, current_step_s(model, state))
        return cls(
            name,
            healthy,
            model,
            state,
            stale or state.stale,
            loads,
            len(items),
            0.0,
            built_at,
            dispatch_overhead_s,
            correction,
            margins,
            prefix,
            prefix_realized,
            overdue_s,
        )

    @property
    def usable_until(self) -> float:
        """The instant (seconds) the engine's step in progress is predicted to end: until then the
        view describes the replica once ``step_elapsed_s`` is taken off its step wait. NaN when
        timeless; ``built_at`` itself when no step is in progress (idle, or overdue: its tokens
        are about to land)."""
        return self.built_at + self.state.step_remaining_s

    def step_elapsed_s(self, now: float) -> float:
        """Seconds of the step in progress that have passed between ``built_at`` and ``now``
        (0 for a timeless view, never more than the step's remaining time): what a forecast made
        on this view takes off its TTFT at ``now``."""
        age = now - self.built_at
        if not age > 0.0:  # NaN (timeless) or not later
            return 0.0
        left = self.state.step_remaining_s
        return age if age < left else left

    def with_admitted(
        self, request: AdmissionRequest, forecast: Forecast | None, request_class: str | None = None
    ) -> ReplicaView:
        """This view after ``request`` was sent here with ``forecast`` (margin applied; ``None`` on
        a replica without a step model): its prompt joins the engine's queue, its class
        (``request_class``, default the request's) holds one more stream, and every stream's TPOT
        grows by the TPOT it inflicts. O(classes); lets one re-evaluation dispatch several
        requests safely."""
        name = request.request_class if request_class is None else request_class
        inflicted = tpot = 0.0
        output = request.expected_output_tokens
        cached = request.cached_prompt_tokens
        if forecast is not None:
            cached = forecast.cached_prompt_tokens
            inflicted = forecast.inflicted_tpot_s if math.isfinite(forecast.inflicted_tpot_s) else 0.0
            tpot = forecast.tpot_s if math.isfinite(forecast.tpot_s) else 0.0
            output = forecast.output_tokens_used
        extra = self.extra_tpot_s + inflicted
        loads = dict(self.loads)
        current = loads.get(name, EMPTY_LOAD)
        loads[name] = current.with_stream(request.prompt_tokens + output, tpot - extra, output)
        return dataclasses.replace(
            self,
            state=with_queued(self.state, request.prompt_tokens, cached, request.exact_output_tokens),
            loads=loads,
            gateway_streams=self.gateway_streams + 1,
            extra_tpot_s=extra,
        )


def overdue_s(streams: Iterable[TrackedStream[Any]], now: float) -> float:
    """How long past its predicted TTFT the most overdue of ``streams`` that still wait for their
    first token has waited at ``now`` (seconds of the admitter's clock), 0 when none has. Only
    streamed requests count (a first token is seen only for them), and only those with a TTFT
    forecast. In seconds, not as a ratio: a request forecast at a few milliseconds that waits a
    few more says little about the queue."""
    late = 0.0
    for stream in streams:
        ttft = stream.predicted_ttft_s
        live = stream.live
        if ttft >= 0.0 and live.first_token_at is None and live.streamed:  # NaN: no forecast
            over = now - live.started_at - ttft
            if over > late:
                late = over
    return late


def current_step_s(model: StepModel, state: ReplicaState) -> float:
    """The replica's decode step time now, in seconds (0 without a model or decodes).

    Every running stream's TPOT from now on is at least this, so a view built from streams whose
    predictions date from their admission still sees the load that joined since.
    """
    if not model.valid or state.decode_seqs == 0:
        return 0.0
    batch = StepBatch(
        prefill_tokens=state.background_prefill_tokens_per_step,
        decode_seqs=state.decode_seqs,
        kv_tokens_read=state.kv_tokens_in_use,
    )
    return model.step_time(batch)


def with_queued(
    state: ReplicaState, prompt_tokens: int, cached_prompt_tokens: int = 0, output_tokens: int | None = None
) -> ReplicaState:
    """``state`` with one more request waiting in the engine's queue (its uncached prompt to
    prefill; its output when pinned, ``None``: not known, and then the slots' schedule is not)."""
    own = prompt_tokens - min(cached_prompt_tokens, prompt_tokens - 1)
    pairs = state.queued_prefill_attn_pairs
    if pairs is not None:
        pairs += own * (own / 2.0 + (prompt_tokens - own))
    # Positional construction: dataclasses.replace costs several times more on this hot path.
    return ReplicaState(
        state.num_running,
        state.num_waiting + 1,
        state.decode_seqs,
        state.kv_tokens_in_use,
        state.kv_capacity_tokens,
        state.max_num_seqs,
        state.max_num_batched_tokens,
        state.max_model_len,
        state.queued_prefill_tokens + own,
        state.queued_requests + 1,
        pairs,
        state.mean_remaining_output_tokens,
        state.release_steps,
        state.release_kv_cumulative,
        state.background_prefill_tokens_per_step,
        state.stale,
        state.step_remaining_s,
        state.prefill_share,
        state.finish_rate_per_s,
        state.steady_step_s,
        state.arriving_prompt_tokens_per_s,
        state.full_finish_rate_per_s,
        slots_after_one_more(state.slot_steps, output_tokens),
    )
