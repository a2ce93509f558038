"""A refusal's story: the wait it cites, the forecast it cites, and its message.

``WaitEstimates.waits`` gives, for a blocked candidate, (seconds until the failing constraints
could hold, seconds until a fresh retry could be admitted): the first delays the first token, the
second is the Retry-After; ``inf`` when never (no finite wait is longer than the replica's drain
to idle). ``_as_judged`` is the forecast a refusal cites (the TTFT as judged: margins and dispatch
overhead in; ``None`` without a step model); ``late_message`` and ``blocked_message`` say in one
line which forecast failed against which target, in the prediction headers' numbers.
"""

from __future__ import annotations

import math
from typing import Final

from gateway.admission.config import AdmissionSettings, ClassSettings
from gateway.admission.decision import _KV, _SLOT, _STALL, _STREAMS, _TPOT, _TTFT, _YTPOT, _YTTFT, Blocker
from gateway.admission.idle import IdleForecasts, _idle_after_s
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import decode_drain_s, remaining_tokens, ttft_excess_s
from gateway.admission.shares import kv_share_limit
from gateway.admission.slack import SlackRules, _Candidate
from predictor import Forecast, ReplicaState

_INF: Final = math.inf


def _as_judged(c: _Candidate, now: float) -> Forecast | None:
    """``c``'s forecast with the TTFT admission held against the deadline (margins and the
    replica's dispatch overhead in): what a refusal's prediction headers and message both cite."""
    f = c.forecast
    if f is None or not math.isfinite(c.ttft_s) or c.ttft_s == f.ttft_s:
        return f
    return f.with_overhead(c.ttft_s, f.overhead_s + c.ttft_s - f.ttft_s, now)


#: What keeps a request off every replica, in a client's words: never a replica's name or an
#: internal identifier (the request's log line carries the replica, ``sluice_admission_*`` the blocker).
_BLOCKER_WORDS: Final[dict[str, str]] = {
    Blocker.TTFT: "its first token would be late",
    Blocker.TPOT: "its time per output token would exceed its TPOT target",
    Blocker.STREAMS_TPOT: "it would slow the running streams past their TPOT targets",
    Blocker.STREAMS_STALL: "its prompt would stall the running streams longer than their targets allow",
    Blocker.KV_SHARE: "its class's share of the KV cache is in use",
    Blocker.SLOT_SHARE: "its class's share of the decode slots is in use",
    Blocker.YIELD_TTFT: "it yields to the first tokens of a higher-priority class",
    Blocker.YIELD_TPOT: "it yields to the TPOT targets of a higher-priority class's streams",
    Blocker.UNMODELLED: "every replica is still being calibrated and at its in-flight limit",
    Blocker.NO_REPLICA: "no healthy replica can serve it",
    Blocker.PROMPT_SIZE: "its prompt is too large",
    Blocker.QUEUE_FULL: "its class's queue is full",
    Blocker.HELD_BACK: "requests that have waited longer go first",
    Blocker.CONCURRENCY: "every replica holds its most requests at once",
    Blocker.SATURATED: "every replica is saturated",
}


def blocker_words(blocker: str | None) -> str:
    """What ``blocker`` (a ``Blocker`` value) means to a client, in a few words."""
    if blocker is None:
        return "no replica can take it yet"
    return _BLOCKER_WORDS.get(blocker, "no replica can take it yet")


def _tpot_story(cls: ClassSettings, c: _Candidate) -> str:
    """The request's own TPOT forecast against its target, in the prediction header's numbers."""
    f = c.forecast
    assert f is not None
    return (
        f"its predicted time per output token {f.tpot_s * 1e3:.2f} ms exceeds the "
        f"{cls.tpot_target_s * 1e3:.3g} ms TPOT target"
    )


def _blocker_story(cls: ClassSettings, c: _Candidate, blocker: Blocker) -> str:
    """The failing forecast behind ``blocker`` with its target, in the prediction headers' units
    (its own TPOT), or what the constraint means (``blocker_words``)."""
    if blocker == Blocker.TPOT and c.forecast is not None:
        return _tpot_story(cls, c)
    return blocker_words(blocker)


def hopeless_advice(name: str, blocker: Blocker | None, *, client_bound: bool = False) -> str:
    """What to change when even an idle replica could not serve the request in class ``name``:
    the target or limit that fails (``blocker``; TTFT when ``None``), as a sentence."""
    where = f"admission.classes.{name}"
    if blocker == Blocker.TPOT:
        return (
            f"Raise the TPOT target ({where}.tpot_target_s) or send the request in a class with a looser one."
        )
    if blocker == Blocker.KV_SHARE:
        return (
            f"Lower max_tokens or shorten the prompt, or raise the class's KV-cache share ({where}.kv_share)."
        )
    if blocker in (Blocker.TTFT, None):
        if client_bound:
            return "Shorten the prompt or allow a later deadline."
        return f"Shorten the prompt, or raise the TTFT target ({where}.ttft_target_s)."
    return f"Change the class's limits ({where}) or send the request in another class."


def _hopeless_tail(name: str, missed: Blocker, client_bound: bool = False) -> str:
    advice = hopeless_advice(name, missed, client_bound=client_bound)
    return f". Not attainable even on an idle replica, so retrying cannot help: {advice}"


def late_message(
    request: AdmissionRequest,
    cls: ClassSettings,
    c: _Candidate,
    blocker: Blocker,
    wait: float,
    first: float,
    deadline: float,
    hopeless: Blocker | None,
) -> str:
    """Why the first token would be late: the predicted TTFT (the ``x-sluice-predicted-ttft-ms``
    header's number, as judged: margins and dispatch overhead in), after ``wait`` seconds
    for ``blocker`` when it must wait for one. ``hopeless``: the target even an idle replica would
    miss (``IdleForecasts.missed_when_idle``; ``None``: retrying can help). A wait that never ends,
    or a TPOT missed even when idle, is told as ``blocked_message`` tells it: that target fails,
    not the TTFT. No replica is named."""
    name = request.request_class
    if not math.isfinite(first) or hopeless == Blocker.TPOT:
        return blocked_message(cls, c, blocker if hopeless is None else hopeless, hopeless, name)
    bound = request.client_bound(cls)
    target = "the client's deadline" if bound else f"the {cls.ttft_target_s:.3g} s TTFT target"
    late = first - deadline
    ttft = f"predicted TTFT {c.ttft_s * 1e3:.1f} ms"
    if wait > 0.0:
        ttft = f"{_blocker_story(cls, c, blocker)} for about {wait:.3g} s more, then a {ttft}"
    tail = "" if hopeless is None else _hopeless_tail(name, hopeless, bound)
    return f"first token predicted {late:.3g} s after {target}: {ttft}{tail}"


def blocked_message(
    cls: ClassSettings, c: _Candidate, blocker: Blocker, hopeless: Blocker | None, class_name: str
) -> str:
    """Why no replica takes the request of class ``class_name`` now: the forecast that failed,
    with its target (its numbers as the prediction headers print them), or what blocks it; when
    ``hopeless`` (the target even an idle replica would miss), what to change. No replica is named."""
    tail = "" if hopeless is None else _hopeless_tail(class_name, hopeless)
    if blocker == Blocker.TPOT and c.forecast is not None:
        return f"{_tpot_story(cls, c)}{tail}"
    return f"no replica can take this request now: {blocker_words(blocker)}{tail}"


def queue_deadline_message(blocker: str | None, waited_s: float | None = None) -> str:
    """Why a queued request is refused: predicted to wait past its queue deadline (``waited_s``
    ``None``), or it waited ``waited_s`` seconds and its deadline passed; what it waited for."""
    why = blocker_words(blocker)
    if waited_s is None:
        return f"still waiting for a replica ({why}); predicted to wait past its queue deadline"
    return f"waited {waited_s:.3g} s in the queue ({why}); its deadline passed"


class WaitEstimates:
    """How long a blocked request would wait on a candidate (see the module docstring).

    ``slack`` gives a class's decode-slot limit on a replica, ``idle`` the forecast on its idle copy.
    """

    def __init__(self, settings: AdmissionSettings, slack: SlackRules, idle: IdleForecasts) -> None:
        self._settings = settings
        self._default = settings.classes[settings.default_class]
        self._slack = slack
        self._idle = idle

    def waits(
        self, request: AdmissionRequest, cls: ClassSettings, c: _Candidate, slots: tuple[int, ...]
    ) -> tuple[float, float]:
        """(seconds until the failing non-TTFT constraints could hold, seconds until a fresh retry
        could be admitted here): the first delays its first token, the second is its Retry-After."""
        assert c.slacks is not None
        wait = 0.0
        for i in slots:
            if c.slacks[i] < 0.0 and i != _TTFT:
                wait = max(wait, self._wait_for(i, request, cls, c))
        retry = wait
        if _TTFT in slots and c.slacks[_TTFT] < 0.0:
            retry = max(retry, ttft_excess_s(c.ttft_s, request.fresh_ttft_budget_s(cls)))
        # Once everything on the replica now has finished, it is idle, where the request fits
        # unless even an idle copy would miss (``IdleForecasts.hopeless``, the reason an estimate is ``inf``):
        # no finite estimate is longer than that. The gateway's own streams there are known one
        # by one (``max_finish_s``), the rest from the state's mean, at the forecast's TPOT.
        idle = _idle_after_s(c.view.state, c.tpot_s, c.output_tokens)
        for load in c.view.loads.values():
            if load.max_finish_s > idle:
                idle = load.max_finish_s
        if wait > idle and math.isfinite(wait):
            wait = idle
        if retry > idle and math.isfinite(retry):
            retry = idle
        return wait, retry

    def _wait_for(self, slot: int, request: AdmissionRequest, cls: ClassSettings, c: _Candidate) -> float:
        """Predicted seconds until constraint ``slot`` would hold on ``c`` (drain estimates)."""
        view = c.view
        assert c.raw is not None
        state, model = view.state, view.model
        tpot, output = c.tpot_s, c.output_tokens
        name = (
            request.request_class
            if request.request_class in self._settings.classes
            else self._settings.default_class
        )
        own = view.loads.get(name)
        if slot == _TPOT:
            drain = decode_drain_s(state, model, tpot - cls.tpot_target_s, tpot)
            if math.isinf(drain) and self._idle.forecast(request, c)[1] <= cls.tpot_target_s:
                # No number of running decodes leaving brings the TPOT under target, yet an idle
                # copy meets it: the excess is the replica's load as a whole (the steady state
                # its recent arrivals settle at, which a burst inflates), not its batch. That
                # passes as the running requests are replaced: wait a typical one's duration,
                # not forever (which would refuse the request as hopeless, without Retry-After).
                return self._or_typical(0.0, state, tpot, output)
            return drain
        if slot == _STREAMS:
            infl, extra = c.inflicted_tpot_s, view.extra_tpot_s
            waits = []
            for stream_class, load in view.loads.items():
                limit = self._settings.classes.get(stream_class, self._default).tpot_target_s - infl - extra
                if load.max_tpot_s > limit:
                    waits.append(load.wait_for_tpot_below_s(limit))
            return self._or_typical(max(waits, default=0.0), state, tpot, output)
        if slot == _STALL:
            stall = c.inflicted_stall_s
            waits = []
            for stream_class, load in view.loads.items():
                k = self._settings.classes.get(stream_class, self._default)
                over = k.max_stall_s is not None and k.max_stall_s < stall
                if over or k.stall_budget_horizon is not None:
                    waits.append(load.max_finish_s)
            return self._or_typical(max(waits, default=0.0), state, tpot, output)
        if slot == _KV:
            limit = kv_share_limit(cls.kv_share, state)
            used = own.kv_tokens if own is not None else 0.0
            if request.prompt_tokens + output > limit:
                return _INF  # larger than the whole share: never here
            need_kv = used + request.prompt_tokens + output - limit
            return self._or_typical(
                own.wait_for_kv_s(need_kv) if own is not None else 0.0, state, tpot, output
            )
        if slot == _SLOT and own is not None:
            limit_seqs = self._slack.slot_limit(cls, view)
            return self._or_typical(own.wait_for_finishes_s(own.seqs + 1 - limit_seqs), state, tpot, output)
        if slot == _YTTFT:
            keep = 1.0 - self._settings.yield_margin
            return max((ttft_excess_s(pt, keep * p.ttft_target_s) for p, pt, _ in c.probes), default=0.0)
        if slot == _YTPOT:
            keep = 1.0 - self._settings.yield_margin
            return max(
                (decode_drain_s(state, model, pp - keep * p.tpot_target_s, pp) for p, _, pp in c.probes),
                default=0.0,
            )
        return self._or_typical(0.0, state, tpot, output)

    @staticmethod
    def _or_typical(wait: float, state: ReplicaState, tpot_s: float, typical_tokens: float) -> float:
        """``wait``, or when the blocking streams are not known individually (admitted since the
        view was built, or not the gateway's), the time a typical running request takes to finish
        at ``tpot_s``: the state's mean remaining output, or where it does not say
        ``typical_tokens`` (the output the blocked request's forecast assumed: the traffic the
        gateway sees), else ``DEFAULT_REMAINING_TOKENS``."""
        if wait > 0.0:
            return wait
        return remaining_tokens(state, typical_tokens) * tpot_s
