"""The attainment controller: each class's admission margin per replica, held by feedback.

Every admitted request is an *outcome* of its class on its replica: it met both targets (first
token by its deadline, mean time per output token within the class's TPOT target) or it did not.
Its caller judges it as soon as that is known: a request still without a first token at its
deadline has missed, and is judged then, not when its late stream ends (in a burst, when it
matters); any other at its end. The controller keeps, per (class, replica), a sliding window of
outcomes (at most ``window_requests``, none older than ``window_s``) and moves the admission
*margin* there, the fraction by which the SLO admitter inflates that class's forecasts on that
replica before it holds them against the targets (``admission.forecast_margin`` is where it
starts and where it returns):

* **tighter** when the requests admitted since the margin last moved clearly fall short of the
  class's ``attainment_target`` plus ``deadband``: the upper end of their attainment's Wilson
  interval (``confidence``, one-sided) is below it. The margin's multiplier ``1 + margin``
  grows by ``min(max_step, gain x shortfall)``. Aiming a deadband above the target keeps the
  attainment at or above it, not around it.
* **looser** when they clearly meet it with room to spare (the interval's lower end at or above
  the target and the estimate at least ``deadband`` above it) *while* the class is being refused
  on that replica on its forecasts, at the margin in force (a refusal since it last moved, within
  ``window_s``): anti-windup, a margin that refuses nothing is not loosened further. And only
  once the margin has been in force as long as the longest request of the last ``window_s``
  took, so that the long requests admitted at it are judged too, not only the short ones that
  end first, and while the whole window (the misses that caused a tightening included) clearly
  meets the target as well.
  The multiplier shrinks by ``min(max_step, gain x surplus)``.
* loosening by a smaller share of a full step each time a loosening went too far (halved at
  each tightening that follows one, down to an eighth): the margin hunting for the loosest one
  that holds the target swings less at every turn; tightening always takes full steps;
* never below ``min_margin``, never above ``max_margin``;
* back towards ``forecast_margin`` (half-life ``decay_half_life_s``, in the multiplier's log)
  while the window holds no outcome and the class is refused there: a margin that refuses every
  request there (so nothing there ends) comes back on its own. While no request of the class
  comes at all, the margin stays as learned: an idle spell says nothing of the forecasts' error,
  and the traffic after it is judged by what the traffic before it taught.

Only the outcomes of requests admitted *after* the margin last moved count towards the next
move: a request admitted before it says nothing about the new margin. This is what keeps the loop
from winding up while the window still holds the misses that caused the last step (a sliding
window lags by its length), and ``min_samples`` of them are needed before any move.

Pure and sans-I/O: times are the caller's clock, in seconds; nothing reads a clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from statistics import NormalDist

from gateway.admission.config import AdmissionSettings, AttainmentSettings

__all__ = [
    "AttainmentController",
    "AttainmentState",
    "Verdict",
    "met_targets",
    "wilson_interval",
]


def wilson_interval(met: int, samples: int, z: float) -> tuple[float, float]:
    """The Wilson score interval of a share ``met / samples`` at ``z`` standard deviations:
    (lower, upper) within [0, 1]; (0, 1) for no samples. Unlike the normal approximation it stays
    sensible for shares near 0 or 1 and a few samples (all 20 met: lower 0.92 at z 1.28)."""
    if samples <= 0:
        return 0.0, 1.0
    p = met / samples
    z2 = z * z
    denominator = 1.0 + z2 / samples
    centre = (p + z2 / (2.0 * samples)) / denominator
    half = z / denominator * math.sqrt(p * (1.0 - p) / samples + z2 / (4.0 * samples * samples))
    return max(0.0, centre - half), min(1.0, centre + half)


def met_targets(first_token_at: float, deadline_s: float, tpot_s: float | None, tpot_target_s: float) -> bool:
    """Whether a request met both its targets: its first token at or before ``deadline_s``
    (its class's TTFT target after arrival, or the client's earlier deadline; same clock as
    ``first_token_at``) and its mean time per output token ``tpot_s`` within ``tpot_target_s``
    (``None``: fewer than two output tokens, no TPOT to meet). Seconds."""
    return first_token_at <= deadline_s and (tpot_s is None or tpot_s <= tpot_target_s)


@dataclass(frozen=True, slots=True)
class AttainmentState:
    """One (class, replica) as the controller sees it at an instant (for the admin view and metrics).

    ``margin``: the margin admission applies there now (a fraction: forecasts x (1 + margin)).
    ``attainment``: share of the window's outcomes that met both targets (``None``: no outcome).
    ``samples``: outcomes in the window. ``lower``/``upper``: the share's Wilson interval
    (``confidence``). ``evidence``: outcomes of requests admitted since the margin last moved.
    ``refusing``: the class was refused there on its forecasts at the margin in force (since it
    last moved, within ``window_s``).
    ``target``: the class's ``attainment_target``.
    """

    request_class: str
    replica: str
    margin: float
    attainment: float | None
    samples: int
    lower: float
    upper: float
    evidence: int
    refusing: bool
    target: float

    def as_json(self) -> dict[str, object]:
        """JSON-ready, for the admin view (shares and margin rounded to 4 places)."""
        return {
            "class": self.request_class,
            "replica": self.replica,
            "margin": round(self.margin, 4),
            "attainment": None if self.attainment is None else round(self.attainment, 4),
            "samples": self.samples,
            "lower": round(self.lower, 4),
            "upper": round(self.upper, 4),
            "evidence": self.evidence,
            "refusing": self.refusing,
            "target": self.target,
        }


@dataclass(slots=True)
class Verdict:
    """One judged request: admitted at ``admitted_at``, judged at ``judged_at`` (seconds of the
    caller's clock), whether it ``met`` both targets. The handle ``judge`` returns."""

    admitted_at: float
    judged_at: float
    met: bool


@dataclass(slots=True)
class _Key:
    """One (class, replica): its window, its margin's log multiplier ``log(1 + margin)``, when it
    last moved (``moved_at``) and which way (``direction``: +1 tighter, -1 looser, 0 never), the
    share of a full step its loosenings take now (``damping``), when it last decayed to, when the
    class was last refused there, and when its refusals since the last outcome began
    (``refusing_since``; -inf: none)."""

    log_scale: float
    moved_at: float = -math.inf
    direction: int = 0
    damping: float = 1.0
    decayed_to: float = -math.inf
    refused_at: float = -math.inf
    refusing_since: float = -math.inf
    window: deque[Verdict] = field(default_factory=deque)
    #: (ended at, admission-to-end seconds) of the outcomes of the last ``window_s``, longest
    #: first, each longer than every later one (a sliding maximum; the count bound does not
    #: apply: a busy replica's last 200 outcomes are its short requests).
    durations: deque[tuple[float, float]] = field(default_factory=deque)


class AttainmentController:
    """Per (class, replica) admission margins held by the attainment admitted requests reach.

    ``judge`` each admitted request once its outcome is known (``lasted`` when it ends;
    ``observe``: both at its end), ``refused`` each refusal of a class the margin may have
    caused, and read ``margins`` when building a replica's view. Pairs never seen have
    ``forecast_margin``. Hot reload (``reconfigure``) keeps the windows and margins and clamps
    the margins into the new bounds; ``enabled: false`` makes every margin ``forecast_margin``
    (the windows still fill, so attainment stays visible).
    """

    def __init__(self, settings: AdmissionSettings) -> None:
        self._keys: dict[tuple[str, str], _Key] = {}
        self._apply(settings)

    def reconfigure(self, settings: AdmissionSettings) -> None:
        """Swap in a new ``admission`` section: windows stay, margins are clamped to its bounds."""
        self._apply(settings)
        low, high = self._bounds
        for key in self._keys.values():
            key.log_scale = min(max(key.log_scale, low), high)

    def _apply(self, settings: AdmissionSettings) -> None:
        self._settings = settings
        a: AttainmentSettings = settings.attainment
        self._a = a
        self._base = math.log1p(settings.forecast_margin)
        self._bounds = (
            math.log1p(min(a.min_margin, settings.forecast_margin)),
            math.log1p(max(a.max_margin, settings.forecast_margin)),
        )
        self._z = NormalDist().inv_cdf(a.confidence)
        self._targets = {name: c.attainment_target for name, c in settings.classes.items()}

    # -- inputs --------------------------------------------------------------------------------------
    def observe(self, request_class: str, replica: str, admitted_at: float, now: float, met: bool) -> Verdict:
        """A request of ``request_class`` admitted to ``replica`` at ``admitted_at`` ended at
        ``now`` having ``met`` both its targets (``met_targets``): ``judge`` and ``lasted`` at once."""
        verdict = self.judge(request_class, replica, admitted_at, now, met)
        self.lasted(request_class, replica, admitted_at, now)
        return verdict

    def judge(self, request_class: str, replica: str, admitted_at: float, now: float, met: bool) -> Verdict:
        """A request of ``request_class`` admitted to ``replica`` at ``admitted_at`` is judged at
        ``now``: ``met`` both its targets (``met_targets``), or missed (a request still without a
        first token at its deadline, judged before it ends). May move the margin there. Its end,
        when it comes later, is told by ``lasted``."""
        key = self._key(request_class, replica, now)
        verdict = Verdict(admitted_at, now, met)
        key.window.append(verdict)
        self._prune(key, now)
        self._step_key(key, request_class, now)
        return verdict

    def retract(self, verdict: Verdict, request_class: str, replica: str) -> None:
        """Forget ``verdict``: its request turned out not to be one to judge (its replica refused
        it, and it is placed again or refused)."""
        key = self._keys.get((request_class, replica))
        if key is not None:
            for i, o in enumerate(key.window):
                if o is verdict:
                    del key.window[i]
                    return

    def lasted(self, request_class: str, replica: str, admitted_at: float, now: float) -> None:
        """A request of ``request_class`` admitted to ``replica`` at ``admitted_at`` ended at
        ``now``: how long requests take there, which a loosening waits for (``_settled``)."""
        key = self._key(request_class, replica, now)
        durations, took = key.durations, now - admitted_at
        while durations and durations[-1][1] <= took:
            durations.pop()
        durations.append((now, took))
        self._prune(key, now)

    def _step_key(self, key: _Key, request_class: str, now: float) -> None:
        if self._a.enabled:
            self._step(key, self._targets.get(request_class, self._default_target()), now)

    def refused(self, request_class: str, replica: str, now: float) -> None:
        """A request of ``request_class`` was refused or held on ``replica`` on its forecasts
        (TTFT, TPOT, or the running streams' TPOT or stalls), where a looser margin could have
        let it in: the margin there may loosen while this lasts (``window_s``)."""
        key = self._key(request_class, replica, now)
        last = key.window[-1].judged_at if key.window else -math.inf
        if key.refusing_since <= last:
            key.refusing_since = now
        key.refused_at = now

    # -- reads ---------------------------------------------------------------------------------------
    def margin(self, request_class: str, replica: str, now: float) -> float:
        """The margin (fraction) admission applies to ``request_class``'s forecasts on ``replica``."""
        if not self._a.enabled:
            return self._settings.forecast_margin
        key = self._keys.get((request_class, replica))
        if key is None:
            return self._settings.forecast_margin
        self._decay(key, now)
        return self._margin_of(key)

    def _margin_of(self, key: _Key) -> float:
        """``key``'s margin: exactly ``forecast_margin`` where it has not moved (no rounding)."""
        if key.log_scale == self._base:
            return self._settings.forecast_margin
        return math.expm1(key.log_scale)

    def margins(self, replica: str, now: float) -> Mapping[str, float]:
        """Every class's margin on ``replica`` that differs from ``forecast_margin`` (the others
        have it), for its view (``ReplicaView.margins``)."""
        if not self._a.enabled:
            return {}
        found: dict[str, float] = {}
        for (cls, name), key in self._keys.items():
            if name == replica:
                self._decay(key, now)
                if key.log_scale != self._base:
                    found[cls] = self._margin_of(key)
        return found

    def states(self, now: float) -> Iterator[AttainmentState]:
        """Every (class, replica) seen, as of ``now``, ordered by class then replica."""
        for (cls, replica), key in sorted(self._keys.items()):
            self._prune(key, now)
            samples = len(key.window)
            met = sum(1 for o in key.window if o.met)
            lower, upper = wilson_interval(met, samples, self._z)
            evidence = sum(1 for o in key.window if o.admitted_at >= key.moved_at)
            yield AttainmentState(
                cls,
                replica,
                self.margin(cls, replica, now),
                met / samples if samples else None,
                samples,
                lower,
                upper,
                evidence,
                self._refusing_now(key, now),
                self._targets.get(cls, self._default_target()),
            )

    def forget(self, replica: str) -> None:
        """Drop everything known of ``replica`` (it left the fleet)."""
        for pair in [p for p in self._keys if p[1] == replica]:
            del self._keys[pair]

    # -- the loop ------------------------------------------------------------------------------------
    def _default_target(self) -> float:
        return self._settings.class_settings(self._settings.default_class).attainment_target

    def _key(self, request_class: str, replica: str, now: float) -> _Key:
        key = self._keys.get((request_class, replica))
        if key is None:
            key = self._keys[(request_class, replica)] = _Key(self._base)
        else:
            self._decay(key, now)
        return key

    def _prune(self, key: _Key, now: float) -> None:
        window, a = key.window, self._a
        oldest = now - a.window_s
        while window and (len(window) > a.window_requests or window[0].judged_at < oldest):
            window.popleft()
        durations = key.durations
        while durations and durations[0][0] < oldest:
            durations.popleft()

    def _decay(self, key: _Key, now: float) -> None:
        """Bring the margin back towards ``forecast_margin`` for the time the window has been
        empty while the class was refused there (from the last outcome's expiry, the first refusal
        after it, or the last decay, to ``now``)."""
        if key.log_scale == self._base:
            return
        window = key.window
        a = self._a
        last = window[-1].judged_at if window else -math.inf
        if key.refusing_since <= last:
            return  # no refusal since the last outcome: idle, not locked out
        empty_since = max(last + a.window_s, key.decayed_to, key.moved_at, key.refusing_since)
        if now <= empty_since or now - last <= a.window_s:
            return
        keep = 0.5 ** ((now - empty_since) / a.decay_half_life_s)
        offset = (key.log_scale - self._base) * keep
        # Within a thousandth of the multiplier: back where it started.
        key.log_scale = self._base if abs(offset) < 1e-3 else self._base + offset
        key.decayed_to = now
        if key.log_scale == self._base:  # starts afresh: full steps
            key.direction, key.damping = 0, 1.0

    @staticmethod
    def _settled(key: _Key, now: float) -> bool:
        """Whether requests of every length, admitted at the margin in force, had time to end: as
        long since it moved as the longest admission-to-end of the last ``window_s``. The short
        ones end first and meet; judged on them alone, a loosening comes too soon."""
        longest = key.durations[0][1] if key.durations else 0.0
        return now - key.moved_at >= longest

    def _window_has_room(self, key: _Key, target: float) -> bool:
        """Whether the whole window, misses from before the last move included, clearly meets
        ``target`` (Wilson lower end): a tightening is not undone while its cause is in view."""
        met = sum(1 for o in key.window if o.met)
        return wilson_interval(met, len(key.window), self._z)[0] >= target

    def _refusing_now(self, key: _Key, now: float) -> bool:
        """Whether the margin in force refuses: a refusal since it last moved, within ``window_s``
        (a looser margin that refuses nothing more would only wind up)."""
        return key.refused_at >= key.moved_at and now - key.refused_at <= self._a.window_s

    def _step(self, key: _Key, target: float, now: float) -> None:
        a = self._a
        evidence = [o for o in key.window if o.admitted_at >= key.moved_at]
        samples = len(evidence)
        if samples < a.min_samples:
            return
        met = sum(1 for o in evidence if o.met)
        share = met / samples
        lower, upper = wilson_interval(met, samples, self._z)
        low, high = self._bounds
        if upper < target + a.deadband:
            direction, error = 1, max(target + a.deadband - share, 0.0)
        elif (
            lower >= target
            and share >= target + a.deadband
            and self._refusing_now(key, now)
            and self._settled(key, now)
            and self._window_has_room(key, target)
        ):
            direction, error = -1, share - target
        else:
            return
        # Loosening steps shrink each time a loosening went too far (the margin tightens again):
        # the margin hunting for the loosest one that holds the target swings less at every
        # turn. Tightening is never damped: a shortfall is met at full speed.
        damping = key.damping
        if direction > 0 and key.direction < 0:
            damping = max(_MIN_DAMPING, damping / 2.0)
        step = math.log1p(min(a.max_step, a.gain * error) * (damping if direction < 0 else 1.0))
        moved = min(max(key.log_scale + direction * step, low), high)
        if moved != key.log_scale:
            key.log_scale = moved
            key.moved_at = now
            key.direction = direction
            key.damping = damping


#: Least share of a full step a loosening takes, however often the margin has turned.
_MIN_DAMPING = 0.125
