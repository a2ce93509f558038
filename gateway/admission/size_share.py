"""Size fairness: no prompt-size quartile of a class shut out under overload.

Under overload the SLO admitter refuses long prompts first: their prefill takes the most of the
running streams' budgets and their own first token comes last, so while short prompts keep
arriving a long one rarely finds room. ``SizeShares`` measures, per class, the admission rate of
each prompt-size quartile over a sliding window, and names the quartiles that fall below
``min_share`` of the best one's (``ClassSettings.size_fairness``). The controller marks a new
request of such a quartile ``size_protected``; the admitter then queues it when only the
replicas' load blocks it (instead of refusing it on a wait forecast that assumes the load stays),
and the queue puts it first (the most starved band's first, by its ``standing``) and holds the
class's other requests back while it waits, so that the streams' budgets grow until it fits.
Nothing is relaxed: it is sent only when every limit holds, running streams' and its own
targets included, and refused when its own first token could no longer come in time.

The quartiles are cut from the window's own prompt sizes (edges as the goodput bench cuts a
trace's: ``bench.goodput.metrics.prompt_quartile_edges``), so they follow the class's traffic.
Memory is bounded by ``max_samples`` decided requests per class; the edges and rates are
recomputed every ``_REFRESH_EVERY`` decisions (or a sixteenth of those kept, if more) or
``_REFRESH_S`` seconds, O(n log n) each: O(log n) per decision, amortised.
Pure: the caller passes the time (seconds of its clock).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import Final

from gateway.admission.config import AdmissionSettings, SizeFairnessSettings

__all__ = ["BANDS", "BandShares", "QuartileRow", "SizeShareTracker", "SizeShares"]

#: Prompt-size bands: quartiles.
BANDS: Final = 4
#: Decisions recorded (at least ``_REFRESH_EVERY``, and a ``_REFRESH_SHARE`` of those kept), or
#: seconds passed, before the bands and their rates are recomputed.
_REFRESH_EVERY: Final = 32
_REFRESH_SHARE: Final = 1 / 16
_REFRESH_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class BandShares:
    """One class's prompt-size quartiles over the window.

    ``edges``: the three quartile edges in tokens (a size equal to an edge belongs to the lower
    band). ``offered``/``admitted``: decided and admitted requests per band, shortest first.
    ``starved``: the bands whose rate is below ``min_share`` of the best judged band's (a band is
    judged with at least ``min_samples`` decisions). ``best_rate``: that best rate (0-1; 0 when
    no band is judged).
    """

    edges: tuple[int, ...]
    offered: tuple[int, ...]
    admitted: tuple[int, ...]
    starved: frozenset[int]
    best_rate: float = 0.0

    def band(self, prompt_tokens: int) -> int:
        """The band (0 = shortest .. 3 = longest) of a prompt of ``prompt_tokens``."""
        return bisect.bisect_left(self.edges, prompt_tokens)

    def standing(self, band: int) -> float:
        """``band``'s admission rate as a share of the best judged band's (0-1; 1 when nothing is
        admitted, or ``band`` has no decision): how starved it is, the lower the more."""
        offered = self.offered[band]
        if not self.best_rate > 0.0 or not offered:
            return 1.0
        return min(1.0, self.admitted[band] / offered / self.best_rate)

    def rates(self) -> tuple[float, ...]:
        """Admitted / decided per band, 0-1; NaN for a band with no decision."""
        return tuple(a / o if o else math.nan for a, o in zip(self.admitted, self.offered, strict=True))

    def as_json(self) -> dict[str, object]:
        """The bands for the admin view: edges, counts, rates (``null`` where none), starved bands."""
        return {
            "edges_tokens": list(self.edges),
            "offered": list(self.offered),
            "admitted": list(self.admitted),
            "admission_rate": [None if math.isnan(r) else round(r, 4) for r in self.rates()],
            "protected_bands": sorted(self.starved),
        }


@dataclass(frozen=True, slots=True)
class QuartileRow:
    """One class's prompt-size quartile over the window, as the metrics export it.

    ``quartile``: 1 (shortest) .. 4 (longest). ``decided``/``admitted``: requests in the window.
    ``protected``: its new requests are ``size_protected`` (only where the class protects).
    """

    request_class: str
    quartile: int
    decided: int
    admitted: int
    protected: bool


_EMPTY: Final = BandShares((), (0,) * BANDS, (0,) * BANDS, frozenset())


def _shares(sizes: list[int], admitted: list[bool], settings: SizeFairnessSettings) -> BandShares:
    """The bands of the decisions (``sizes[i]`` tokens, ``admitted[i]``) under ``settings``."""
    if not sizes:
        return _EMPTY
    ordered = sorted(sizes)
    n = len(ordered)
    edges = tuple(ordered[math.ceil(k * n / BANDS) - 1] for k in range(1, BANDS))  # nearest rank
    offered, taken = [0] * BANDS, [0] * BANDS
    for size, ok in zip(sizes, admitted, strict=True):
        k = bisect.bisect_left(edges, size)
        offered[k] += 1
        taken[k] += ok
    judged = [k for k in range(BANDS) if offered[k] >= settings.min_samples]
    best = max((taken[k] / offered[k] for k in judged), default=0.0)
    floor = settings.min_share * best
    starved = frozenset(k for k in judged if taken[k] / offered[k] < floor)
    return BandShares(edges, tuple(offered), tuple(taken), starved, best)


class SizeShareTracker:
    """One class's decided requests over the window: (time, prompt tokens, admitted)."""

    def __init__(self, settings: SizeFairnessSettings) -> None:
        self._settings = settings
        self._events: deque[tuple[float, int, bool]] = deque(maxlen=settings.max_samples)
        self._shares = _EMPTY
        self._pending = 0
        self._refreshed_at = -math.inf

    def reconfigure(self, settings: SizeFairnessSettings) -> None:
        """New settings: the decisions kept stay (the newest ``max_samples``)."""
        if settings.max_samples != self._settings.max_samples:
            self._events = deque(self._events, maxlen=settings.max_samples)
        self._settings = settings
        self._refreshed_at = -math.inf  # recomputed at the next look

    def record(self, prompt_tokens: int, admitted: bool, now: float) -> None:
        """A request of ``prompt_tokens`` was admitted (sent to a replica) or refused at ``now``."""
        self._events.append((now, prompt_tokens, admitted))
        self._pending += 1

    def shares(self, now: float, *, fresh: bool = False) -> BandShares:
        """The bands over the window ending at ``now``: recomputed when due, or now with ``fresh``
        and new decisions since (the admin view)."""
        every = max(_REFRESH_EVERY, int(len(self._events) * _REFRESH_SHARE))
        due = self._pending >= every or now - self._refreshed_at >= _REFRESH_S
        if due or (fresh and self._pending > 0):
            events = self._events
            oldest = now - self._settings.window_s
            while events and events[0][0] < oldest:
                events.popleft()
            self._shares = _shares([e[1] for e in events], [e[2] for e in events], self._settings)
            self._pending = 0
            self._refreshed_at = now
        return self._shares

    def starved(self, prompt_tokens: int, now: float) -> bool:
        """Whether a request of ``prompt_tokens`` falls in a band held below its share."""
        return self.standing(prompt_tokens, now) is not None

    def standing(self, prompt_tokens: int, now: float) -> float | None:
        """The standing (``BandShares.standing``, 0 to below ``min_share``) of the band a request
        of ``prompt_tokens`` falls in when that band is held below its share; ``None``: it is not."""
        shares = self.shares(now)
        if not shares.starved:
            return None
        band = shares.band(prompt_tokens)
        return shares.standing(band) if band in shares.starved else None


class SizeShares:
    """Every class's ``SizeShareTracker`` (made on first use), for one admission controller."""

    def __init__(self, settings: AdmissionSettings) -> None:
        self._settings = settings
        self._trackers: dict[str, SizeShareTracker] = {}

    def reconfigure(self, settings: AdmissionSettings) -> None:
        """A new ``admission`` section: each class's tracker takes its new settings; the trackers
        of classes no longer configured are dropped."""
        self._settings = settings
        for name in list(self._trackers):
            cls = settings.classes.get(name)
            if cls is None:
                del self._trackers[name]
            else:
                self._trackers[name].reconfigure(cls.size_fairness)

    def _tracker(self, name: str) -> SizeShareTracker:
        tracker = self._trackers.get(name)
        if tracker is None:
            tracker = SizeShareTracker(self._settings.class_settings(name).size_fairness)
            self._trackers[name] = tracker
        return tracker

    def protects(self, name: str, prompt_tokens: int, now: float) -> bool:
        """Whether a new request of class ``name`` and ``prompt_tokens`` is protected: the class
        protects its sizes and the request's band is below its share."""
        return self.standing(name, prompt_tokens, now) is not None

    def standing(self, name: str, prompt_tokens: int, now: float) -> float | None:
        """A new request of class ``name`` and ``prompt_tokens``: its band's standing (0 to below
        ``min_share``; the queue takes the lowest first) when it is protected, else ``None``."""
        if not self._settings.class_settings(name).size_fairness.enabled:
            return None
        return self._tracker(name).standing(prompt_tokens, now)

    def record(self, name: str, prompt_tokens: int, admitted: bool, now: float) -> None:
        """A request of class ``name`` was admitted or refused (not counted while it waits)."""
        self._tracker(name).record(prompt_tokens, admitted, now)

    def rows(self, now: float) -> list[QuartileRow]:
        """Each class's quartiles over the window ending at ``now`` (classes with no decision
        left out); ``protected`` only where the class protects its sizes."""
        out: list[QuartileRow] = []
        for name, tracker in sorted(self._trackers.items()):
            shares = tracker.shares(now, fresh=True)
            if not any(shares.offered):
                continue
            on = self._settings.class_settings(name).size_fairness.enabled
            for k in range(BANDS):
                protected = on and k in shares.starved
                out.append(QuartileRow(name, k + 1, shares.offered[k], shares.admitted[k], protected))
        return out

    def as_json(self, now: float) -> dict[str, dict[str, object]]:
        """Each class's bands over the window ending at ``now`` (``BandShares.as_json``)."""
        return {name: t.shares(now, fresh=True).as_json() for name, t in sorted(self._trackers.items())}
