"""The replicas Sluice routes to: their health state, cached models and outstanding requests.

One ``Replica`` per configured name, reconciled on a settings swap (unchanged replicas keep their
object, so outstanding counts and health carry over a reload). Each keeps the gateway's own
unfinished requests on it (``Replica.in_flight``), which the scraper merges into snapshots.
Routing: healthy replicas serving the model, fewest outstanding requests first, ties round robin;
a request is outstanding from dispatch until its response fully ends (``ReplicaRegistry.lease``).
Health is a small counter machine (``Replica.record``) fed by the checker and the proxy.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gateway.api.responses import ModelCard
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.replicas.config import HealthSettings, ReplicaSettings
from gateway.replicas.snapshot import InFlight

log = logging.getLogger("sluice.replicas")


#: Longest an ejected replica is kept out, in seconds.
MAX_EJECT_S = 60.0


class ReplicaState(enum.StrEnum):
    """``unknown`` until the first check; routable only when ``healthy``."""

    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class LiveRequest:
    """One request the gateway dispatched to a replica and has not finished (mutable, in place).

    The proxy bumps ``tokens_streamed`` and sets ``last_token_at`` once per content-carrying SSE
    event (vLLM sends one chunk per engine step per sequence), so this is a plain slotted object:
    two attribute stores per event, no allocation. ``freeze()`` gives the immutable ``InFlight``
    the scraper and the forecast take. ``prompt_tokens`` is an estimate (characters / learned
    characters-per-token) until the replica's usage arrives; ``started_at``,
    ``first_token_at`` and ``last_token_at`` are monotonic seconds (dispatch; first and latest
    token relayed, ``None`` before the first); ``max_tokens`` is the output cap in tokens
    (``None``: the client set none). Admission reads ``last_token_at - first_token_at`` as the
    time the stream's decode has taken so far (its stall budget, ``StreamingRequest``).
    ``cached_tokens``: prompt tokens admission expected to hit the replica's prefix cache (set
    when it is sent; 0: none). ``exact_output``: the output tokens it will produce, when the
    client pinned them (``ignore_eos`` with ``max_tokens``); ``None``: not known.
    """

    __slots__ = (
        "cached_tokens",
        "exact_output",
        "first_token_at",
        "last_token_at",
        "max_tokens",
        "prompt_tokens",
        "request_id",
        "started_at",
        "streamed",
        "tokens_streamed",
    )

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        started_at: float,
        max_tokens: int | None = None,
        *,
        streamed: bool = True,
        exact_output: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.tokens_streamed = 0
        self.started_at = started_at
        self.max_tokens = max_tokens
        #: Whether its tokens are relayed as they come (a stream). A non-streamed response
        #: arrives whole at the end: until then ``tokens_streamed`` stays 0 and admission
        #: estimates its progress instead (``TrackedStream``).
        self.streamed = streamed
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.cached_tokens = 0
        self.exact_output = exact_output

    def freeze(self, tokens_streamed: int | None = None) -> InFlight:
        """The request as of now, as an immutable ``InFlight``; ``tokens_streamed``: the output
        tokens to say it has (an estimate, for a request whose tokens are not seen), instead of
        the count relayed."""
        return InFlight(
            self.request_id,
            self.prompt_tokens,
            self.tokens_streamed if tokens_streamed is None else tokens_streamed,
            self.started_at,
            self.max_tokens,
            last_token_at=self.last_token_at,
            first_token_at=self.first_token_at,
            cached_tokens=self.cached_tokens,
            exact_output_tokens=self.exact_output,
        )


class Replica:
    """One replica. Mutated only from the event loop (no locks needed)."""

    def __init__(self, settings: ReplicaSettings) -> None:
        self.settings = settings
        self.state = ReplicaState.UNKNOWN
        #: Requests dispatched to it and not yet fully answered.
        self.outstanding = 0
        #: The leased requests that carry a ``LiveRequest``, in dispatch order (a dict as an
        #: ordered set: ids are client-chosen and may repeat, objects never do).
        self._live: dict[LiveRequest, None] = {}
        #: Its models, by id, from its last successful ``/v1/models``; ``None`` = never fetched.
        self.models: dict[str, ModelCard] | None = None
        self.consecutive_ok = 0
        self.consecutive_failures = 0
        #: Removed from the configuration; kept alive only until its outstanding requests end.
        self.retired = False
        #: Why the last check failed (for ``/readyz`` and the transition log).
        self.last_error: str | None = None
        #: The engine found by probing the replica, when its ``backend`` is ``auto``.
        self.detected_engine: str | None = None
        #: Proxied requests in a row that timed out on it, and ejections in a row (outlier detection).
        self.consecutive_timeouts = 0
        self.ejections = 0
        #: Monotonic time until which health checks cannot bring it back (it was ejected).
        self.ejected_until = 0.0
        #: Monotonic time of its next health check while unhealthy (checks back off); 0: due.
        self.next_check_at = 0.0
        #: Monotonic time until which it is left alone: it refused a request as overloaded
        #: (its own 429 or 503). ``0.0``: never refused.
        self.saturated_until = 0.0

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def base_url(self) -> str:
        """The replica's URL without a trailing slash; append ``/v1/...`` to it."""
        return self.settings.url.rstrip("/")

    def record(self, ok: bool, health: HealthSettings, *, error: str | None = None) -> ReplicaState | None:
        """Count one check result; return the new state if it changed, else ``None``.

        A healthy replica becomes unhealthy after ``unhealthy_after`` consecutive failures; an
        unhealthy one healthy after ``healthy_after`` consecutive successes. From ``unknown`` the
        first failure already means unhealthy (so startup reports dead replicas at once).
        """
        if ok and time.monotonic() < self.ejected_until:
            return None  # ejected: its /health answering proves nothing yet
        if ok:
            self.consecutive_ok += 1
            self.consecutive_failures = 0
            self.last_error = None
            if self.state != ReplicaState.HEALTHY and self.consecutive_ok >= health.healthy_after:
                return self._move_to(ReplicaState.HEALTHY)
            return None
        self.consecutive_failures += 1
        self.consecutive_ok = 0
        self.last_error = error
        if self.state == ReplicaState.UNKNOWN or (
            self.state == ReplicaState.HEALTHY and self.consecutive_failures >= health.unhealthy_after
        ):
            return self._move_to(ReplicaState.UNHEALTHY)
        return None

    def _move_to(self, state: ReplicaState) -> ReplicaState:
        self.state = state
        if state == ReplicaState.HEALTHY:
            log.info("replica %s (%s) is healthy", self.name, self.base_url)
        else:
            log.warning("replica %s (%s) is unhealthy: %s", self.name, self.base_url, self.last_error or "?")
        return state

    @property
    def engine(self) -> str | None:
        """The engine it runs (``vllm``, ``tgi``, ``sglang``): as configured, or as detected when
        configured ``auto`` (``None`` until detected)."""
        declared = str(self.settings.backend)
        return self.detected_engine if declared == "auto" else declared

    def saturated(self, now: float) -> bool:
        """It refused a request as overloaded and its back-off has not expired at ``now``."""
        return now < self.saturated_until

    def serves(self, model: str, engine: str | None = None) -> bool:
        """It serves ``model`` (and runs ``engine``, when one is required)."""
        if engine is not None and self.engine != engine:
            return False
        return self.models is not None and model in self.models

    def in_flight(self) -> tuple[InFlight, ...]:
        """The gateway's unfinished requests on this replica, oldest dispatch first."""
        return tuple(live.freeze() for live in self._live)

    @property
    def in_flight_count(self) -> int:
        """How many requests ``in_flight()`` would return."""
        return len(self._live)

    def max_model_len(self) -> int | None:
        """The smallest context length its ``/v1/models`` lists, in tokens; ``None`` if none says."""
        if not self.models:
            return None
        lengths = [card.max_model_len for card in self.models.values() if card.max_model_len is not None]
        return min(lengths) if lengths else None

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary for ``/readyz``."""
        return {
            "name": self.name,
            "url": self.base_url,
            "state": self.state.value,
            "outstanding": self.outstanding,
            "in_flight": len(self._live),
            "models": sorted(self.models) if self.models is not None else None,
            "error": self.last_error,
        }


class NoReplica(enum.Enum):
    """Why ``pick`` found no replica: the model is unknown, its replicas are all unhealthy, or the
    healthy ones all refused requests as overloaded moments ago (``Replica.saturated``)."""

    UNKNOWN_MODEL = "unknown_model"
    NONE_HEALTHY = "none_healthy"
    SATURATED = "saturated"


@dataclass(frozen=True, slots=True)
class ReconcileResult:
    """Replica names added, retired (draining) and kept by one reconcile."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    kept: tuple[str, ...]


#: Called after every reconcile that follows a settings swap.
ReconcileListener = Callable[[ReconcileResult], None]


class ReplicaRegistry:
    """All replicas of the current settings, in configuration order, plus any still draining."""

    def __init__(self, store: SettingsStore) -> None:
        self._store = store
        self._replicas: dict[str, Replica] = {}
        self._draining: set[Replica] = set()
        self._next = 0
        self._closed = False
        self._listeners: list[ReconcileListener] = []
        self.reconcile(store.current.all_replicas())
        store.subscribe(self._on_swap)

    def close(self) -> None:
        """Stop following settings swaps (the store offers no unsubscribe)."""
        self._closed = True

    def on_reconcile(self, listener: ReconcileListener) -> None:
        """Call ``listener(result)`` after each reconcile caused by a settings swap (errors logged)."""
        self._listeners.append(listener)

    def _on_swap(self, old: Settings, new: Settings) -> None:
        if self._closed:
            return
        result = self.reconcile(new.all_replicas())
        for listener in list(self._listeners):
            try:
                listener(result)
            except Exception:
                log.exception("reconcile listener %r failed", listener)

    def reconcile(self, wanted: list[ReplicaSettings]) -> ReconcileResult:
        """Make the registry match ``wanted``: add new names, retire missing ones, keep the rest.

        A replica whose settings changed (e.g. its URL) is replaced by a fresh object; the old one
        drains like a removed one. A change of ``hardware:`` alone keeps the object (with its
        health and requests) and updates its settings: those facts only inform the predictor.
        Retired replicas are never picked again; they leave the registry when their last
        outstanding request ends.
        """
        old = self._replicas
        fresh: dict[str, Replica] = {}
        added: list[str] = []
        kept: list[str] = []
        for replica_settings in wanted:
            current = old.get(replica_settings.name)
            if current is not None and _same_endpoint(current.settings, replica_settings):
                current.settings = replica_settings
                fresh[replica_settings.name] = current
                kept.append(replica_settings.name)
            else:
                fresh[replica_settings.name] = Replica(replica_settings)
                added.append(replica_settings.name)
        removed = [r for name, r in old.items() if fresh.get(name) is not r]
        self._replicas = fresh
        for replica in removed:
            self._retire(replica)
        if added or removed:
            log.info(
                "replicas reconciled: added %s, removed %s, kept %s",
                added or "-",
                [r.name for r in removed] or "-",
                kept or "-",
            )
        return ReconcileResult(tuple(added), tuple(r.name for r in removed), tuple(kept))

    def _retire(self, replica: Replica) -> None:
        replica.retired = True
        if replica.outstanding > 0:
            self._draining.add(replica)
            log.info("replica %s retired; draining %d request(s)", replica.name, replica.outstanding)

    def replicas(self) -> list[Replica]:
        """The configured (non-retired) replicas, in configuration order."""
        return list(self._replicas.values())

    def draining(self) -> list[Replica]:
        """Retired replicas that still have outstanding requests."""
        return sorted(self._draining, key=lambda r: r.name)

    def get(self, name: str) -> Replica | None:
        return self._replicas.get(name)

    def healthy(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.state == ReplicaState.HEALTHY]

    def pick(self, model: str, *, engine: str | None = None, now: float | None = None) -> Replica | NoReplica:
        """The replica for a request on ``model`` (least outstanding, ties round robin), or why not.

        ``engine``: only replicas running it (TGI's native routes). ``now`` (monotonic seconds)
        decides which replicas are still backing off an overload refusal. ``UNKNOWN_MODEL`` only when
        every replica's model list is known and none serves it; when some replica's list was
        never fetched, the model might be there: ``NONE_HEALTHY``.
        """
        candidates = [r for r in self.healthy() if r.serves(model, engine)]
        if not candidates:
            return self._why_none(model)
        now = time.monotonic() if now is None else now
        rested = [r for r in candidates if not r.saturated(now)]
        if not rested:
            return NoReplica.SATURATED
        candidates = rested
        least = min(r.outstanding for r in candidates)
        tied = [r for r in candidates if r.outstanding == least]
        chosen = tied[self._next % len(tied)]
        self._next += 1
        return chosen

    def _why_none(self, model: str) -> NoReplica:
        replicas = self._replicas.values()
        if any(r.serves(model) or r.models is None for r in replicas):
            return NoReplica.NONE_HEALTHY
        return NoReplica.UNKNOWN_MODEL

    @contextmanager
    def lease(self, replica: Replica, live: LiveRequest | None = None) -> Iterator[Replica]:
        """Count one outstanding request on ``replica`` for the duration of the ``with`` block.

        With ``live``, the request is also in ``replica.in_flight()`` for that duration: it
        leaves on every exit (success, error, cancellation).
        """
        replica.outstanding += 1
        if live is not None:
            replica._live[live] = None
        try:
            yield replica
        finally:
            replica.outstanding -= 1
            if live is not None:
                replica._live.pop(live, None)
            if replica.retired and replica.outstanding == 0 and replica in self._draining:
                self._draining.discard(replica)
                log.info("replica %s drained and removed", replica.name)

    def report_failure(self, replica: Replica, error: str) -> ReplicaState | None:
        """A connection error while proxying: counts as one failed health check at once."""
        if replica.retired:
            return None
        return replica.record(False, self._store.current.health, error=error)

    def report_timeout(self, replica: Replica, error: str) -> ReplicaState | None:
        """A proxied request timed out on ``replica``. After ``health.eject_after_timeouts`` in a
        row it is ejected: unhealthy for ``health.eject_s`` (doubling per ejection in a row, at
        most 60 s) whatever its health checks say, as Envoy's outlier detection does."""
        if replica.retired:
            return None
        health = self._store.current.health
        replica.consecutive_timeouts += 1
        if replica.consecutive_timeouts < health.eject_after_timeouts:
            return None
        replica.consecutive_timeouts = 0
        eject_s = min(MAX_EJECT_S, health.eject_s * 2.0**replica.ejections)
        replica.ejections += 1
        replica.ejected_until = time.monotonic() + eject_s
        replica.consecutive_ok = 0
        replica.last_error = f"{error} (ejected for {eject_s:.0f} s)"
        if replica.state == ReplicaState.UNHEALTHY:
            return None
        return replica._move_to(ReplicaState.UNHEALTHY)

    def report_success(self, replica: Replica) -> None:
        """A proxied request got its answer from ``replica``: its timeout and ejection streaks end."""
        replica.consecutive_timeouts = 0
        replica.ejections = 0

    def saturate(self, replica: Replica, now: float, back_off_s: float, why: str) -> None:
        """``replica`` refused a request as overloaded at ``now``: route around it for
        ``back_off_s`` seconds (monotonic clock). Logged once per episode, not per refusal."""
        if not replica.saturated(now):
            log.warning(
                "replica %s is overloaded (%s): routing around it for %.1f s", replica.name, why, back_off_s
            )
        replica.saturated_until = max(replica.saturated_until, now + back_off_s)

    def engine_models(self, engine: str) -> list[str]:
        """Ids of the models healthy replicas running ``engine`` serve, sorted, each once."""
        found = {m for r in self.healthy() if r.engine == engine and r.models is not None for m in r.models}
        return sorted(found)

    def model_groups(self) -> dict[str, list[ReplicaSettings]]:
        """Each model's replica group: the settings of the replicas whose last model list names
        it (healthy or not, draining ones left out), in configuration order, by model id."""
        groups: dict[str, list[ReplicaSettings]] = {}
        for replica in self._replicas.values():
            for model in replica.models or ():
                groups.setdefault(model, []).append(replica.settings)
        return groups

    def healthy_models(self) -> list[Mapping[str, ModelCard]]:
        """Model lists of the healthy replicas, in configuration order."""
        return [r.models for r in self.healthy() if r.models is not None]

    def describe(self) -> list[dict[str, Any]]:
        """JSON-ready state of every replica, draining ones included (``/readyz``)."""
        described = [r.describe() for r in self._replicas.values()]
        described += [{**r.describe(), "state": "draining"} for r in self.draining()]
        return described


def _same_endpoint(a: ReplicaSettings, b: ReplicaSettings) -> bool:
    """True when ``a`` and ``b`` differ at most in ``hardware`` (facts for the predictor only)."""
    return a.model_copy(update={"hardware": b.hardware}) == b
