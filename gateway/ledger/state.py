"""The replica ledger's pure parts: entries, their wire form, what a gateway publishes of its own
requests (``Outbox``) and what it holds of the others' (``RemoteLedger``). No I/O, no clock:
every time is passed in.

Times on the wire are wall-clock seconds (``time.time()``: gateways on different hosts share no
monotonic clock); ``RemoteLedger.in_flight`` turns them into the reader's monotonic seconds with
the offset it is given (wall - monotonic, read by the caller).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final, Literal, Protocol

from gateway.admission.shares import StreamingRequest
from gateway.replicas.snapshot import InFlight

__all__ = [
    "Entry",
    "Message",
    "Op",
    "Outbox",
    "RemoteLedger",
    "Saturation",
    "TrackedSource",
    "decode_entry",
    "decode_message",
    "encode_entry",
    "encode_message",
    "widen",
]

#: How long a removed entry's key is remembered, in seconds of the reader's clock, so that a
#: snapshot read before the removal cannot bring it back.
TOMBSTONE_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class Entry:
    """One in-flight request a gateway dispatched to a replica, as the ledger holds it.

    ``key``: unique across gateways (``<gateway>/<n>``). ``prompt_tokens``: the dispatching
    gateway's count or estimate. ``predicted_output``: its predicted output, tokens (``None``:
    none made). ``max_tokens``: the output cap (``None``: none set). ``request_class``: the class it
    was admitted as (``None``: unknown). ``dispatched_at`` and ``first_token_at``: wall-clock
    seconds (``None``: no token yet). ``tokens``: output tokens so far (estimated by the sender for
    a request whose tokens are not relayed as they come). ``version``: bumped by the sender at
    each update; a reader keeps the highest. ``cached_tokens``: prompt tokens the sender expected
    to hit the replica's prefix cache (0: none). ``predicted_tpot_s``: its TPOT forecast at
    dispatch, seconds (``None``: none made): what the other gateways hold their newcomers to, as
    they do for their own running streams.
    """

    gateway: str
    key: str
    replica: str
    prompt_tokens: int
    predicted_output: float | None
    max_tokens: int | None
    request_class: str | None
    dispatched_at: float
    first_token_at: float | None
    tokens: int
    version: int
    cached_tokens: int = 0
    predicted_tpot_s: float | None = None

    def streaming(self) -> StreamingRequest | None:
        """As a running stream admission protects (``ReplicaView.loads``): its class (``""``:
        unknown, judged by the default class's targets), prompt, tokens so far, predicted output
        and TPOT; its decode's elapsed time is not known here (taken as its TPOT per token).
        ``None`` without a TPOT forecast."""
        tpot = self.predicted_tpot_s
        if tpot is None or not tpot > 0.0:
            return None
        output = self.predicted_output if self.predicted_output is not None else float(self.tokens)
        return StreamingRequest(self.request_class or "", self.prompt_tokens, self.tokens, output, tpot)

    def in_flight(self, offset: float) -> InFlight:
        """As the forecast takes it, its times moved to the reader's monotonic clock
        (``offset``: the reader's wall minus monotonic seconds). No ``last_token_at``: the newest
        token of another gateway's stream is known only to ``progress_interval_s``, too coarse to
        place the replica's engine step."""
        first = None if self.first_token_at is None else self.first_token_at - offset
        return InFlight(
            self.key,
            self.prompt_tokens,
            self.tokens,
            self.dispatched_at - offset,
            self.max_tokens,
            first_token_at=first,
            cached_tokens=self.cached_tokens,
        )


def encode_entry(entry: Entry) -> str:
    """``entry`` as one compact JSON array (a Redis hash value)."""
    return json.dumps(
        [
            entry.gateway,
            entry.key,
            entry.replica,
            entry.prompt_tokens,
            entry.predicted_output,
            entry.max_tokens,
            entry.request_class,
            round(entry.dispatched_at, 6),
            None if entry.first_token_at is None else round(entry.first_token_at, 6),
            entry.tokens,
            entry.version,
            entry.cached_tokens,
            None if entry.predicted_tpot_s is None else round(entry.predicted_tpot_s, 6),
        ],
        separators=(",", ":"),
    )


def decode_entry(text: str | bytes) -> Entry | None:
    """The entry ``encode_entry`` wrote (or, without ``cached_tokens`` or ``predicted_tpot_s``,
    an earlier version); ``None`` for anything malformed (never raises)."""
    try:
        row = json.loads(text)
        g, k, r, p, out, cap, cls, at, first, tokens, version, *more = row
        cached = int(more[0]) if more else 0
        tpot = float(more[1]) if len(more) > 1 and more[1] is not None else None
        return Entry(
            str(g),
            str(k),
            str(r),
            int(p),
            None if out is None else float(out),
            None if cap is None else int(cap),
            None if cls is None else str(cls),
            float(at),
            None if first is None else float(first),
            int(tokens),
            int(version),
            cached,
            tpot,
        )
    except (ValueError, TypeError):
        return None


#: One change to publish: ``("put", entry)`` or ``("del", entry)`` (the entry as last published).
Op = tuple[Literal["put", "del"], Entry]


#: A replica's own refusal as overloaded: (replica, back-off seconds).
Saturation = tuple[str, float]


@dataclass(frozen=True, slots=True)
class Message:
    """One pub/sub message: a gateway's changes (``ops``) and the overload refusals it met."""

    gateway: str
    ops: list[Op]
    saturations: list[Saturation]


def encode_message(gateway: str, ops: Iterable[Op], saturations: Iterable[Saturation] = ()) -> str:
    """One pub/sub message of ``gateway``'s ``ops`` (puts carry the whole entry, deletes its
    replica and key) and ``saturations``."""
    rows: list[Any] = []
    for kind, entry in ops:
        rows.append(["p", encode_entry(entry)] if kind == "put" else ["d", entry.replica, entry.key])
    body: dict[str, Any] = {"g": gateway, "o": rows}
    sats = [[replica, round(back_off_s, 3)] for replica, back_off_s in saturations]
    if sats:
        body["s"] = sats
    return json.dumps(body, separators=(",", ":"))


def decode_message(text: str | bytes) -> Message | None:
    """The message ``encode_message`` wrote; ``None`` when malformed. A delete's entry carries
    only its gateway, replica and key."""
    try:
        body = json.loads(text)
        gateway = str(body["g"])
        ops: list[Op] = []
        for row in body["o"]:
            if row[0] == "p":
                entry = decode_entry(row[1])
                if entry is not None:
                    ops.append(("put", entry))
            elif row[0] == "d":
                ops.append(
                    ("del", Entry(gateway, str(row[2]), str(row[1]), 0, None, None, None, 0.0, None, 0, 0))
                )
        sats = [(str(r), float(s)) for r, s in body.get("s", ())]
        return Message(gateway, ops, sats)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None


class TrackedSource(Protocol):
    """What the outbox reads of a request admission tracks (``admission.views.TrackedStream``)."""

    request_class: str
    expected_output_tokens: float
    predicted_tpot_s: float

    def in_flight(self, now: float) -> Any: ...


@dataclass(slots=True)
class _Own:
    replica: str
    entry: Entry
    stream: TrackedSource
    #: Monotonic seconds of its last publication (``None``: never published).
    published_at: float | None
    #: Monotonic seconds the stream's first token was seen published (``None``: not yet).
    first_published: bool


class Outbox:
    """This gateway's own in-flight requests and the changes of them not yet published.

    ``dispatched`` and ``finished`` come from admission (each dispatch and end); ``tick(now)``
    looks for progress: a first token is published at the next tick, later tokens at most every
    ``progress_interval_s`` per request. ``drain`` hands over the changes to send, coalesced
    (a request that started and ended between two drains is never sent). At most
    ``max_entries_per_replica`` of its requests per replica are published; beyond, ``unpublished``
    counts them (the others see their load only in the replica's scrapes).
    """

    def __init__(self, gateway: str, *, progress_interval_s: float, max_entries_per_replica: int) -> None:
        self.gateway = gateway
        self.progress_interval_s = progress_interval_s
        self.max_entries_per_replica = max_entries_per_replica
        self._own: dict[object, _Own] = {}
        self._per_replica: dict[str, int] = {}
        #: Pending changes by entry key; a put followed by a del of an unsent entry cancels out.
        self._pending: dict[str, Op] = {}
        self._serial = 0
        self.unpublished = 0

    def __len__(self) -> int:
        return len(self._own)

    @property
    def pending(self) -> int:
        """Changes waiting for the next ``drain``."""
        return len(self._pending)

    def dispatched(
        self, replica: str, live: object, stream: TrackedSource, *, now: float, offset: float
    ) -> None:
        """Admission sent ``live`` (tracked as ``stream``) to ``replica`` at monotonic ``now``;
        ``offset``: wall minus monotonic seconds."""
        if live in self._own:
            return
        if self._per_replica.get(replica, 0) >= self.max_entries_per_replica:
            self.unpublished += 1
            return
        frozen = stream.in_flight(now)
        self._serial += 1
        first = frozen.first_token_at
        entry = Entry(
            self.gateway,
            f"{self.gateway}/{self._serial}",
            replica,
            int(frozen.prompt_tokens),
            float(stream.expected_output_tokens),
            frozen.max_tokens,
            stream.request_class,
            frozen.started_at + offset,
            None if first is None else first + offset,
            int(frozen.tokens_streamed),
            1,
            int(getattr(frozen, "cached_tokens", 0)),
            stream.predicted_tpot_s if stream.predicted_tpot_s > 0.0 else None,
        )
        self._own[live] = _Own(replica, entry, stream, None, first is not None)
        self._per_replica[replica] = self._per_replica.get(replica, 0) + 1
        self._pending[entry.key] = ("put", entry)

    def finished(self, live: object) -> None:
        """``live`` ended (or was dropped): its entry is deleted."""
        own = self._own.pop(live, None)
        if own is None:
            return
        self._per_replica[own.replica] -= 1
        key = own.entry.key
        if own.published_at is None and key in self._pending:
            del self._pending[key]  # never sent: nothing to delete anywhere
        else:
            self._pending[key] = ("del", own.entry)

    def tick(self, now: float, offset: float) -> None:
        """Queue the progress due at monotonic ``now``: a first token at once, later tokens once
        ``progress_interval_s`` has passed since the request was last published."""
        for own in self._own.values():
            if own.published_at is None:
                continue  # its first put is still pending
            frozen = own.stream.in_flight(now)
            tokens = int(frozen.tokens_streamed)
            entry = own.entry
            if tokens == entry.tokens and (own.first_published or frozen.first_token_at is None):
                continue
            first_news = not own.first_published and frozen.first_token_at is not None
            if not first_news and now - own.published_at < self.progress_interval_s:
                continue
            first = frozen.first_token_at
            own.entry = replace(
                entry,
                tokens=tokens,
                first_token_at=None if first is None else first + offset,
                prompt_tokens=int(frozen.prompt_tokens),
                version=entry.version + 1,
            )
            own.first_published = own.first_published or first is not None
            self._pending[entry.key] = ("put", own.entry)

    def drain(self, now: float) -> list[Op]:
        """The pending changes, oldest first; marks the puts published at monotonic ``now``."""
        ops = list(self._pending.values())
        self._pending.clear()
        if ops:
            by_key = {own.entry.key: own for own in self._own.values()}
            for kind, entry in ops:
                own = by_key.get(entry.key) if kind == "put" else None
                if own is not None:
                    own.published_at = now
        return ops

    def requeue(self, ops: Iterable[Op]) -> None:
        """``ops`` (from ``drain``) were not delivered: send them again with the next drain,
        unless a later change of the same entry is pending already."""
        for op in ops:
            self._pending.setdefault(op[1].key, op)

    def entries(self) -> list[Entry]:
        """Every published entry of this gateway, as last published (to write again whole)."""
        return [own.entry for own in self._own.values() if own.published_at is not None]


@dataclass(slots=True)
class _Held:
    entry: Entry
    #: Monotonic seconds (reader's clock) it was last put.
    received_at: float


class RemoteLedger:
    """The other gateways' entries, per replica, as this gateway applies them.

    ``put`` keeps an entry's highest version and ignores this gateway's own and recently deleted
    keys; a replica holds at most ``max_entries_per_replica`` (a new entry beyond is not kept and
    counted in ``dropped``). ``reconcile`` merges a snapshot read of one replica; ``expire`` drops
    the entries of gateways whose heartbeat is gone. Every mutator returns whether the replica's
    entries changed (its views must be rebuilt).
    """

    def __init__(self, gateway: str, *, max_entries_per_replica: int) -> None:
        self.gateway = gateway
        self.max_entries_per_replica = max_entries_per_replica
        self._replicas: dict[str, dict[str, _Held]] = {}
        self._tombstones: dict[str, float] = {}
        self._frozen: dict[str, tuple[InFlight, ...]] = {}
        self._streams: dict[str, tuple[StreamingRequest, ...]] = {}
        self.dropped = 0

    def put(self, entry: Entry, now: float) -> bool:
        """Apply ``entry`` received at monotonic ``now``; whether it changed its replica's entries."""
        if entry.gateway == self.gateway or entry.key in self._tombstones:
            return False
        held = self._replicas.setdefault(entry.replica, {})
        current = held.get(entry.key)
        if current is not None:
            if entry.version <= current.entry.version:
                return False
            current.entry, current.received_at = entry, now
        else:
            if len(held) >= self.max_entries_per_replica:
                self.dropped += 1
                return False
            held[entry.key] = _Held(entry, now)
        self._changed(entry.replica)
        return True

    def knows(self, entry: Entry) -> bool:
        """Whether ``entry``'s key is held or was deleted lately (a put of it is no new dispatch)."""
        return entry.key in self._tombstones or entry.key in self._replicas.get(entry.replica, {})

    def remove(self, replica: str, key: str, now: float) -> bool:
        """The entry ``key`` on ``replica`` ended (deleted at monotonic ``now``)."""
        self._tombstones[key] = now
        held = self._replicas.get(replica)
        if held is None or held.pop(key, None) is None:
            return False
        self._changed(replica)
        return True

    def reconcile(self, replica: str, entries: Iterable[Entry], *, asked_at: float, now: float) -> bool:
        """Merge a read of ``replica``'s entries sent at ``asked_at`` and answered at ``now``
        (monotonic): entries it holds are put; entries held since before ``asked_at`` that it
        lacks ended unseen (a lost message) and go."""
        changed = False
        seen: set[str] = set()
        for entry in entries:
            if entry.replica != replica:
                continue
            seen.add(entry.key)
            changed |= self.put(entry, now)
        held = self._replicas.get(replica, {})
        gone = [k for k, h in held.items() if k not in seen and h.received_at < asked_at]
        for key in gone:
            del held[key]
        if gone:
            self._changed(replica)
        return changed or bool(gone)

    def expire(self, alive: set[str], now: float) -> list[str]:
        """Drop the entries of every gateway not in ``alive``; the replicas whose entries changed.
        Tombstones older than ``TOMBSTONE_S`` are forgotten."""
        touched: list[str] = []
        for replica, held in self._replicas.items():
            dead = [k for k, h in held.items() if h.entry.gateway not in alive]
            for key in dead:
                del held[key]
            if dead:
                self._changed(replica)
                touched.append(replica)
        old = [k for k, at in self._tombstones.items() if now - at > TOMBSTONE_S]
        for key in old:
            del self._tombstones[key]
        return touched

    def clear(self) -> list[str]:
        """Forget every entry (the ledger is unreachable: no finish would be heard); the replicas
        that held some."""
        touched = [r for r, held in self._replicas.items() if held]
        self._replicas.clear()
        self._frozen.clear()
        self._streams.clear()
        return touched

    def gateways(self) -> set[str]:
        """The gateways some held entry belongs to."""
        return {h.entry.gateway for held in self._replicas.values() for h in held.values()}

    def entries(self, replica: str) -> Iterator[Entry]:
        """``replica``'s held entries."""
        return (h.entry for h in self._replicas.get(replica, {}).values())

    def in_flight(self, replica: str, offset: float) -> tuple[InFlight, ...]:
        """``replica``'s held entries as ``InFlight`` on the reader's monotonic clock (``offset``:
        wall minus monotonic seconds); built once per change."""
        frozen = self._frozen.get(replica)
        if frozen is None:
            held = self._replicas.get(replica)
            frozen = () if not held else tuple(h.entry.in_flight(offset) for h in held.values())
            self._frozen[replica] = frozen
        return frozen

    def streams(self, replica: str) -> tuple[StreamingRequest, ...]:
        """``replica``'s held entries that carry a TPOT forecast, as running streams admission
        protects (``Entry.streaming``); built once per change."""
        streams = self._streams.get(replica)
        if streams is None:
            held = self._replicas.get(replica, {})
            made = (h.entry.streaming() for h in held.values())
            streams = self._streams[replica] = tuple(s for s in made if s is not None)
        return streams

    def _changed(self, replica: str) -> None:
        """``replica``'s entries changed: what was built of them goes."""
        self._frozen.pop(replica, None)
        self._streams.pop(replica, None)

    def counts(self) -> dict[str, int]:
        """Held entries per replica (replicas holding none left out)."""
        return {r: len(held) for r, held in self._replicas.items() if held}

    def by_gateway(self, replica: str) -> dict[str, int]:
        """``replica``'s held entries per gateway."""
        found: dict[str, int] = {}
        for h in self._replicas.get(replica, {}).values():
            found[h.entry.gateway] = found.get(h.entry.gateway, 0) + 1
        return found


def widen(
    margins: Callable[[str, float], Mapping[str, float]] | None,
    classes: Callable[[], Iterable[str]],
    forecast_margin: Callable[[], float],
    extra: Callable[[], float],
) -> Callable[[str, float], Mapping[str, float]]:
    """A ``ViewCache.margins`` callback: ``margins``' (``None``: none) with every class's margin
    ``m`` made ``(1 + m) * (1 + extra()) - 1`` while ``extra()`` > 0 (a class ``margins`` leaves out
    has ``forecast_margin()``)."""

    def widened(replica: str, now: float) -> Mapping[str, float]:
        base = {} if margins is None else margins(replica, now)
        more = extra()
        if more <= 0.0:
            return base
        default = forecast_margin()
        return {cls: (1.0 + base.get(cls, default)) * (1.0 + more) - 1.0 for cls in classes()}

    return widened
