"""What admission knows of each replica's prefix cache: indexes, session homes, delivered hits.

``PrefixCaches`` is the engine's (sans I/O, no clock): one ``PrefixIndex`` per replica, fed by
the requests admission sends there (``sent``) and sized to the replica's KV capacity; the
replica each client session was last sent to (session affinity, bounded LRU); and per replica
the share of expected hits it has been delivering, learned from the ``cached_tokens`` its
answers report (``reported``). A replica that caches nothing (prefix caching off) thus drifts to
a share near 0 and its forecasts stop counting hits; one whose answers never say keeps 1.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from gateway.admission.config import PrefixCacheSettings
from gateway.admission.request import AdmissionRequest
from predictor.prefix_index import PrefixIndex, PrefixKey, expected_hit_tokens, prefix_key

__all__ = ["PrefixCaches"]

#: Weight of one answer in the delivered share (an exponential moving average).
_REALIZED_ALPHA: Final = 0.2
#: Capacity of a replica's index before its KV capacity is known, in tokens.
_UNKNOWN_CAPACITY_TOKENS: Final = 1 << 20
#: Most replicas with an index (their indexes are dropped, all at once, beyond it).
_MAX_REPLICAS: Final = 4096


class PrefixCaches:
    """The fleet's prefix caches as admission believes them (see the module).

    ``settings``: the ``admission.prefix_cache`` section (``reconfigure`` swaps it).
    """

    def __init__(self, settings: PrefixCacheSettings) -> None:
        self._settings = settings
        self._indexes: dict[str, PrefixIndex] = {}
        self._realized: dict[str, float] = {}
        self._sessions: OrderedDict[str, str] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._settings.enabled

    def reconfigure(self, settings: PrefixCacheSettings) -> None:
        """Swap the settings; turning the feature off forgets every index and session."""
        if not settings.enabled or (settings.block_bytes, settings.max_blocks) != (
            self._settings.block_bytes,
            self._settings.max_blocks,
        ):
            self._indexes.clear()
            self._realized.clear()
        if not settings.enabled:
            self._sessions.clear()
        self._settings = settings
        while len(self._sessions) > settings.max_sessions:
            self._sessions.popitem(last=False)

    # -- a request --------------------------------------------------------------------------------
    def key(self, text: str | None, prompt_tokens: int, model: str) -> PrefixKey | None:
        """The prefix key of a prompt whose text is ``text`` (``None``: unknown, not indexed) and
        size ``prompt_tokens``, for ``model``; ``None`` when off or too short for one block."""
        s = self._settings
        if not s.enabled or not text:
            return None
        return prefix_key(text, prompt_tokens, seed=model, block_bytes=s.block_bytes, max_blocks=s.max_blocks)

    def affinity(self, session: str | None) -> str | None:
        """The replica ``session`` was last sent to (``None``: none, or no session)."""
        if session is None or not self._settings.enabled:
            return None
        return self._sessions.get(session)

    def index(self, replica: str) -> PrefixIndex | None:
        """``replica``'s index (``None``: the feature is off)."""
        if not self._settings.enabled:
            return None
        index = self._indexes.get(replica)
        if index is None:
            if len(self._indexes) >= _MAX_REPLICAS:
                self._indexes.clear()
            index = self._indexes[replica] = PrefixIndex(_UNKNOWN_CAPACITY_TOKENS)
        return index

    def realized(self, replica: str) -> float:
        """The share of expected hits ``replica`` has been delivering, in [0, 1] (1: none known)."""
        return self._realized.get(replica, 1.0)

    def matched_tokens(self, replica: str, request: AdmissionRequest) -> int:
        """Prompt tokens of ``request`` whose blocks ``replica``'s index holds now (the raw hit,
        before the delivered share)."""
        index = self.index(replica)
        return expected_hit_tokens(request.prefix, index, request.prompt_tokens)

    # -- events -----------------------------------------------------------------------------------
    def sent(self, replica: str, request: AdmissionRequest, kv_capacity_tokens: float | None) -> None:
        """``request`` was sent to ``replica`` (whose KV capacity is ``kv_capacity_tokens``;
        ``None``: unknown): its prompt's blocks are cached there now, and its session lives there."""
        s = self._settings
        if not s.enabled:
            return
        index = self.index(replica)
        if index is not None and request.prefix is not None:
            if kv_capacity_tokens is not None and kv_capacity_tokens > 0:
                index.resize(kv_capacity_tokens)
            index.insert(request.prefix)
        session = request.session
        if session is not None:
            sessions = self._sessions
            sessions[session] = replica
            sessions.move_to_end(session)
            while len(sessions) > s.max_sessions:
                sessions.popitem(last=False)

    def reported(self, replica: str, matched_tokens: int, cached_tokens: int | None) -> None:
        """An answer from ``replica`` said ``cached_tokens`` of its prompt hit the cache (``None``:
        it did not say) where the index matched ``matched_tokens``: the delivered share moves."""
        if cached_tokens is None or matched_tokens <= 0 or not self._settings.enabled:
            return
        share = min(1.0, max(0.0, cached_tokens / matched_tokens))
        before = self._realized.get(replica, 1.0)
        self._realized[replica] = before + _REALIZED_ALPHA * (share - before)

    def describe(self) -> dict[str, object]:
        """JSON-ready state for the admin view: per replica the blocks indexed, the prompt
        tokens they stand for, the capacity (tokens) and the share of expected hits delivered;
        and the sessions remembered."""
        return {
            "enabled": self._settings.enabled,
            "sessions": len(self._sessions),
            "replicas": {
                name: {
                    "blocks": len(index),
                    "tokens": round(index.tokens),
                    "capacity_tokens": round(index.capacity_tokens),
                    "delivered_share": round(self.realized(name), 4),
                }
                for name, index in sorted(self._indexes.items())
            },
        }

    def forget(self, replica: str) -> None:
        """``replica`` restarted or left: its cache is empty."""
        self._indexes.pop(replica, None)
        self._realized.pop(replica, None)
