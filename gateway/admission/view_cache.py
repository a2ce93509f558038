"""The replicas' views as admission judges them, cached per route and replica (sans I/O).

``ViewCache`` tracks the streams admission sent to each replica (``TrackedStream``) and builds
each replica's ``ReplicaView`` from the prediction service's inputs. Views are rebuilt on events
only: anything that changes that replica's load (a dispatch to it, a finish on it, its scrape:
``touch``), anything's (a health or settings change: ``changed``), a token of a later engine
step landing there (``SAME_STEP_S``), or, while no request of the gateway's decodes there, the
end of the engine step in progress when it was built (``ReplicaView.usable_until``). In between
only the step's phase moves, which the admitter takes off the step wait
(``ReplicaView.step_elapsed_s``). A view is never older than ``max_age_s``. A flood of refused
requests thus costs about one view build per replica per engine step, not one per request.
Times are seconds of the adapter's clock, passed in as ``now``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from gateway.admission.ports import (
    AdmissionReplica,
    EngineLog,
    PredictionInputs,
    split_route,
)
from gateway.admission.prefix import PrefixCaches
from gateway.admission.shares import StreamingRequest
from gateway.admission.views import NO_MARGINS, LiveEntry, ReplicaView, TrackedStream, overdue_s
from predictor import ReplicaState, unknown_step_model

__all__ = ["SAME_STEP_S", "UNSEEN_MAX_AGE_S", "ViewCache"]

#: A request whose newest token landed this soon (seconds) before the newest of all on its replica
#: when a view was built had its token of that engine step already (``_Cached.seen``): its next
#: token is of a later step, and makes a new view.
SAME_STEP_S: Final = 0.001
#: Longest a view of a replica running non-streamed requests lives (seconds): their progress is
#: estimated from the clock (``TrackedStream.tokens_at``), with no token to mark it.
UNSEEN_MAX_AGE_S: Final = 0.002
#: Replica capacities for a replica the prediction service cannot describe (never binding).
_UNKNOWN_KV: Final = 1 << 40
_UNKNOWN_LEN: Final = 1 << 30
_NO_MODEL: Final = unknown_step_model("replica unknown to the prediction service")


@dataclass(slots=True)
class _Cached:
    """One replica's view for one route, the versions it was built at (everything's, the
    replica's own), and each tracked request there as the view saw it: its tokens streamed, and
    whether its newest token was of the engine step in progress then."""

    view: ReplicaView
    version: int
    replica_version: int
    seen: dict[LiveEntry[Any], tuple[int, bool]]


class TrackListener(Protocol):
    """Told of each request admission starts tracking on a replica, and of its end."""

    def tracked(self, replica: str, entry: Any, stream: TrackedStream[Any]) -> None: ...

    def forgotten(self, replica: str, entry: Any) -> None: ...


class ViewCache:
    """Views of the replicas for the engine (see the module).

    ``predictions``: the replica inputs (step model, state, dispatch overhead, correction).
    ``log``: where a failed replica state and staleness transitions are reported.
    ``max_age_s``: the oldest a cached view may be used, seconds. ``stale_margin``: the margin
    the staleness warning quotes (the ``admission`` section's; the engine keeps it current).
    ``margins``: each class's margin on a replica at an instant (``ReplicaView.margins``; the
    attainment controller's ``margins``), ``None``: none. ``prefix``: the replicas' prefix
    caches (``ReplicaView.prefix``), ``None``: not modelled.
    """

    def __init__(
        self, predictions: PredictionInputs, log: EngineLog, *, max_age_s: float, stale_margin: float
    ) -> None:
        self._predictions = predictions
        self._log = log
        self._max_age_s = max_age_s
        self.stale_margin = stale_margin
        self.margins: Callable[[str, float], Mapping[str, float]] | None = None
        #: Other gateways' in-flight requests on a replica (``gateway.ledger``); ``None``: none.
        self.remote: Callable[[str], Sequence[Any]] | None = None
        #: Those of them with a TPOT forecast, as running streams admission protects (their
        #: classes' targets hold for newcomers of any gateway); ``None``: none.
        self.remote_streams: Callable[[str], Sequence[StreamingRequest]] | None = None
        #: Told of every ``track`` and ``forget`` (``gateway.ledger.LiveLedger``); ``None``: nobody.
        self.listener: TrackListener | None = None
        #: The replicas' prefix caches (``ReplicaView.prefix``); ``None``: not modelled.
        self.prefix: PrefixCaches | None = None
        #: Whether views carry how far the replica's queue runs behind its forecasts
        #: (``ReplicaView.overdue_s``; ``admission.overdue_ttft``); off: 0.
        self.overdue = False
        #: What admission remembers of the requests it sent, per replica.
        self._streams: dict[str, dict[LiveEntry[Any], TrackedStream[Any]]] = {}
        self._views: dict[str, dict[str, _Cached]] = {}
        #: Bumped by anything that changes every view (settings, health); per replica, by what
        #: changes that replica's load (a dispatch to it, a finish there, its scrape).
        self._version = 0
        self._replica_versions: dict[str, int] = {}
        self._stale: dict[str, bool] = {}

    # -- events -------------------------------------------------------------------------------------
    def track(self, replica: str, entry: LiveEntry[Any], stream: TrackedStream[Any]) -> None:
        """A request sent to ``replica`` (``entry``) runs there now, as ``stream`` describes it."""
        self._streams.setdefault(replica, {})[entry] = stream
        self.touch(replica)
        if self.listener is not None:
            self.listener.tracked(replica, entry, stream)

    def forget(self, replica: str, entry: LiveEntry[Any]) -> None:
        """``entry`` no longer runs on ``replica`` (finished, dropped)."""
        streams = self._streams.get(replica)
        if streams is not None and streams.pop(entry, None) is not None:
            self.touch(replica)
            if self.listener is not None:
                self.listener.forgotten(replica, entry)

    def touch(self, replica: str) -> None:
        """``replica``'s load changed (a dispatch, a finish, a scrape): its views are rebuilt."""
        self._replica_versions[replica] = self._replica_versions.get(replica, 0) + 1

    def changed(self) -> None:
        """Every replica's load or health may have changed: every view is rebuilt."""
        self._version += 1

    # -- views --------------------------------------------------------------------------------------
    def cached_view(self, route: str, replica: str) -> ReplicaView | None:
        """The view of ``replica`` for ``route`` the last decision there used (``None``: none yet)."""
        cached = self._views.get(route, {}).get(replica)
        return None if cached is None else cached.view

    def views_for(self, route: str, replicas: Sequence[AdmissionReplica], now: float) -> list[ReplicaView]:
        """Views of ``replicas`` for a request on ``route``: each from the cache while it is
        current (see the module), else rebuilt. Views of replicas not among them are dropped."""
        cache = self._views.get(route)
        if cache is None:
            cache = self._views[route] = {}
        version, versions, max_age = self._version, self._replica_versions, self._max_age_s
        views: list[ReplicaView] = []
        for replica in replicas:
            name = replica.name
            replica_version = versions.get(name, 0)
            cached = cache.get(name)
            if (
                cached is None
                or cached.version != version
                or cached.replica_version != replica_version
                or not self._current(cached, now, max_age)
            ):
                view = self._view(name, route, now)
                cached = cache[name] = _Cached(view, version, replica_version, self._seen_now(name))
            views.append(cached.view)
        if len(cache) > len(replicas):
            # Replicas that left the fleet (or lost health): their views go.
            for name in [n for n in cache if all(r.name != n for r in replicas)]:
                del cache[name]
        return views

    def _current(self, cached: _Cached, now: float, max_age: float) -> bool:
        """Whether ``cached``'s view (versions unchanged) still describes its replica at ``now``:
        younger than ``max_age``, and no token of a later engine step landed there (a request
        whose token of the view's step had landed got another, or any got two). While some
        tracked request decodes there every step ends with its tokens; otherwise (prefill only)
        the view lasts until the step it was built in is predicted to end. A replica running
        requests whose tokens are not seen has its view rebuilt every ``UNSEEN_MAX_AGE_S``."""
        view = cached.view
        age = now - view.built_at
        if age > max_age:
            return False
        seen = cached.seen
        any_token = unseen = False
        for live in self._streams.get(view.name, {}):
            if not live.streamed:
                unseen = True
            tokens = live.tokens_streamed
            if tokens:
                any_token = True
            before = seen.get(live)
            if before is not None:
                moved = tokens - before[0]
                if moved > 1 or (moved == 1 and before[1]):
                    return False  # the next step's tokens: its phase is not in the view
        if unseen and age > UNSEEN_MAX_AGE_S:
            return False
        return any_token or not (now > view.usable_until and view.state.step_remaining_s > 0.0)

    def _seen_now(self, replica: str) -> dict[LiveEntry[Any], tuple[int, bool]]:
        """Each tracked request on ``replica``: (tokens streamed, whether its newest token landed
        within ``SAME_STEP_S`` of the newest of all there)."""
        streams = self._streams.get(replica)
        if not streams:
            return {}
        newest = max((live.last_token_at or -math.inf for live in streams), default=-math.inf)
        edge = newest - SAME_STEP_S
        return {
            live: (live.tokens_streamed, live.last_token_at is not None and live.last_token_at >= edge)
            for live in streams
        }

    def _view(self, replica: str, route: str, now: float) -> ReplicaView:
        model, _ = split_route(route)
        streams = self._streams.get(replica, {})
        in_flight = [s.in_flight(now) for s in streams.values()]
        if self.remote is not None:
            in_flight.extend(self.remote(replica))
        try:
            step_model, state = self._predictions.replica_inputs(
                replica, model=model, tenant=None, in_flight=in_flight, now=now
            )
        except Exception:
            self._log.exception("replica state for %s failed; judging it as unmodelled", replica)
            step_model, state = _NO_MODEL, _fallback_state(in_flight)
        self._note_staleness(replica, state.stale)
        running = [s.streaming(now) for s in streams.values()]
        if self.remote_streams is not None:
            running.extend(self.remote_streams(replica))
        return ReplicaView.build(
            replica,
            healthy=True,
            model=step_model,
            state=state,
            streams=running,
            stale=state.stale,
            built_at=now,
            dispatch_overhead_s=self._predictions.dispatch_overhead_s(replica),
            correction=self._predictions.correction(replica, now),
            margins=NO_MARGINS if self.margins is None else self.margins(replica, now),
            prefix=None if self.prefix is None else self.prefix.index(replica),
            prefix_realized=1.0 if self.prefix is None else self.prefix.realized(replica),
            overdue_s=overdue_s(streams.values(), now) if self.overdue else 0.0,
        )

    def _note_staleness(self, name: str, stale: bool) -> None:
        """Report once per transition that a replica is judged on the gateway's own accounting."""
        if stale == self._stale.get(name, False):
            return
        self._stale[name] = stale
        if stale:
            self._log.warning(
                "replica %s: metrics stale; admission judges it by Sluice's in-flight requests and its "
                "last fitted model, predictions +%.0f %%",
                name,
                self.stale_margin * 100,
            )
        else:
            self._log.info("replica %s: metrics fresh again; admission uses them", name)


def _fallback_state(in_flight: Sequence[Any]) -> ReplicaState:
    return ReplicaState.from_sequences(
        [],
        [f.prompt_tokens for f in in_flight],
        kv_capacity_tokens=_UNKNOWN_KV,
        max_num_seqs=1,
        max_num_batched_tokens=1,
        max_model_len=_UNKNOWN_LEN,
    )
