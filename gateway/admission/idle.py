"""Idle replicas: forecasts on an idle copy of a replica (is retrying hopeless?) and drain times.

``IdleForecasts.forecast`` gives a request's (TTFT, TPOT) in seconds on an idle copy of a
candidate's replica, with the margins and dispatch overhead applied as on the replica itself and
its measured correction only where that lowers the forecast (NaN: no step model); ``hopeless``
says whether even that misses the request's targets (then a refusal carries no Retry-After).
A correction learned under a burst may make a request look possible on an idle replica, never
hopeless: that verdict tells clients not to retry, and only admitted requests would unlearn it.
Memoised per request size and replica limits.
``_idle_after_s``: seconds until a replica drains to idle (``inf`` when the step is not a number).
"""

from __future__ import annotations

import math
from typing import Final

from gateway.admission.config import ClassSettings
from gateway.admission.decision import Blocker
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import remaining_tokens
from gateway.admission.slack import _IDLE_STATES_KEPT, SlackRules, _Candidate
from gateway.admission.views import ReplicaView
from predictor import CandidateRequest, ForecastConfig, ReplicaState, StepModel
from predictor.forecast import forecast_values

_INF: Final = math.inf
_EULER: Final = 0.5772156649015329
#: Most forecasts on idle replicas kept for ``hopeless`` (cleared when exceeded).
_IDLE_FORECASTS_KEPT: Final = 1024


def _idle_after_s(state: ReplicaState, step_s: float, typical_tokens: float = 0.0) -> float:
    """Predicted seconds until every request on the replica in ``state`` has finished, its decode
    steps taking ``step_s`` each: the step in progress, then the last of its running and queued
    requests to finish, each with memoryless remaining output of the state's mean (``n`` of them
    all finish after ``mean x H_n`` steps), or where the state does not say (requests the gateway
    does not know one by one) ``typical_tokens`` (0: ``DEFAULT_REMAINING_TOKENS``). 0 for an idle
    replica; ``inf`` when ``step_s`` is not a number."""
    n = state.decode_seqs + state.queued_requests
    if n <= 0:
        return state.step_remaining_s
    if not step_s >= 0.0:
        return _INF
    rest = remaining_tokens(state, typical_tokens)
    return state.step_remaining_s + rest * (math.log(n + 0.5) + _EULER) * step_s


def _idle(state: ReplicaState) -> ReplicaState:
    """The same replica with nothing running or waiting."""
    return ReplicaState(
        0,
        0,
        0,
        0,
        state.kv_capacity_tokens,
        state.max_num_seqs,
        state.max_num_batched_tokens,
        state.max_model_len,
    )


def _is_idle(view: ReplicaView) -> bool:
    """Nothing runs or waits on ``view``'s replica, none of the gateway's requests is there, and
    its metrics are fresh."""
    state = view.state
    return (
        not view.stale
        and view.gateway_streams == 0
        and state.num_running == 0
        and state.num_waiting == 0
        and state.queued_requests == 0
    )


class IdleForecasts:
    """Forecasts on idle copies of replicas, memoised (see the module docstring).

    ``slack`` gives the margins a replica's forecasts get; ``forecast_config`` is passed through to
    the predictor's forecast.
    """

    def __init__(self, slack: SlackRules, forecast_config: ForecastConfig) -> None:
        self._slack = slack
        self._fc = forecast_config
        #: ``hopeless``'s memo: idle copies of replica states by their limits, and forecasts on
        #: them by (request, limits) -> (the step model it was made with, TTFT, TPOT), unscaled.
        #: A flood of rejections is mostly alike requests: one forecast for all of them, not one
        #: per request (a replica's refit gives it a new model object, which misses the memo).
        self._idle_states: dict[tuple[int, int, int, int], ReplicaState] = {}
        self._idle_forecasts: dict[
            tuple[CandidateRequest, tuple[int, int, int, int]], tuple[StepModel, float, float]
        ] = {}

    def hopeless(self, request: AdmissionRequest, cls: ClassSettings, c: _Candidate) -> bool:
        """Whether even an idle copy of the replica would miss the TTFT budget or TPOT target (a
        request of one output token has no TPOT)."""
        return self.missed_when_idle(request, cls, c) is not None

    def missed_when_idle(
        self, request: AdmissionRequest, cls: ClassSettings, c: _Candidate
    ) -> Blocker | None:
        """The target an idle copy of the replica would miss: ``Blocker.TPOT`` when its TPOT does
        (what the client is told to change first), else ``Blocker.TTFT`` when its TTFT does,
        else ``None`` (also without a step model)."""
        ttft, tpot = self.forecast(request, c)
        if math.isnan(ttft):
            return None
        if request.max_tokens_on(c.view.state.max_model_len) <= 1:
            tpot = 0.0
        if tpot > cls.tpot_target_s:
            return Blocker.TPOT
        if ttft > request.fresh_ttft_budget_s(cls):
            return Blocker.TTFT
        return None

    def forecast(self, request: AdmissionRequest, c: _Candidate) -> tuple[float, float]:
        """(TTFT, TPOT) of ``request`` on an idle copy of ``c``'s replica, seconds, with the
        view's margins and dispatch overhead applied as on the replica itself, and its correction
        factors where they are below 1 (see the module docstring; NaN: no model)."""
        view = c.view
        state = view.state
        candidate = request.candidate(state.max_model_len)
        limits = (
            state.kv_capacity_tokens,
            state.max_num_seqs,
            state.max_num_batched_tokens,
            state.max_model_len,
        )
        key = (candidate, limits)
        model = view.model
        known = self._idle_forecasts.get(key)
        if known is not None and known[0] is model:
            ttft, tpot = known[1], known[2]
        else:
            f = forecast_values(candidate, self._idle(state, limits), model, self._fc)
            ttft, tpot = f[0], f[1]
            if len(self._idle_forecasts) >= _IDLE_FORECASTS_KEPT:
                self._idle_forecasts.clear()
            self._idle_forecasts[key] = (model, ttft, tpot)
        scale = self._slack.scale(view)
        ct, cp = view.correction.factors(request.prompt_tokens, 0.0)
        return (ttft * scale + view.dispatch_overhead_s) * min(ct, 1.0), tpot * scale * min(cp, 1.0)

    def _idle(self, state: ReplicaState, key: tuple[int, int, int, int]) -> ReplicaState:
        """``_idle(state)``, kept per set of limits (``key``; a replica's limits rarely change)."""
        idle = self._idle_states.get(key)
        if idle is None:
            if len(self._idle_states) >= _IDLE_STATES_KEPT:
                self._idle_states.clear()
            idle = self._idle_states[key] = _idle(state)
        return idle
