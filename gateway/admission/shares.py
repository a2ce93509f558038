"""What each class holds on a replica, and how much it may hold: the batch-isolation arithmetic.

A class with ``kv_share`` or ``slot_share`` below 1 may hold at most that share of a replica's KV
cache and of its decode slots. KV is counted at each request's projected size (prompt + predicted
output, the most it will hold) because admitting on today's KV is how engines end up preempting
(math.md §7, memory-induced congestion). Decode slots come from the step model, not a fixed count:
the decode batch at which one step takes the tightest TPOT target of any class, capped by the
engine's ``max_num_seqs``.

The per-class aggregates (``ClassLoad``) are built once per replica view in O(k) for k streams,
so each admission check is O(1); the wait estimates (held-back requests only) cost O(k log k)
once per view, then O(log k).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from predictor import ReplicaState, StepModel

__all__ = [
    "EMPTY_LOAD",
    "ClassLoad",
    "StreamingRequest",
    "class_loads",
    "decode_elapsed_s",
    "decode_slot_capacity",
    "kv_share_limit",
    "slot_share_limit",
]


def decode_elapsed_s(first_token_at: float | None, last_token_at: float | None) -> float:
    """Seconds a stream's decode has taken so far: from its first token to its latest one, as
    the gateway saw them relayed (``StreamingRequest.decode_elapsed_s``); 0 before its first
    token. The live gateway and the replay both take it from here, so the stall budget is
    reckoned the same way in both."""
    if first_token_at is None or last_token_at is None:
        return 0.0
    return max(0.0, last_token_at - first_token_at)


@dataclass(frozen=True, slots=True)
class StreamingRequest:
    """A request Sluice dispatched to a replica that has not finished (the gateway's own accounting).

    ``prompt_tokens``: its prompt, in tokens. ``generated_tokens``: output streamed so far.
    ``expected_output_tokens``: its predicted total output (the quantile used at admission).
    ``predicted_tpot_s``: its current predicted mean TPOT in seconds (the forecast at admission,
    or the larger of that and the TPOT observed so far).
    ``decode_elapsed_s``: seconds from its first token to its latest one (what its decode has
    taken so far); ``None``: not known, then taken as ``predicted_tpot_s`` per token so far.
    """

    request_class: str
    prompt_tokens: int
    generated_tokens: int
    expected_output_tokens: float
    predicted_tpot_s: float
    decode_elapsed_s: float | None = None

    @property
    def projected_kv_tokens(self) -> float:
        """KV tokens it will hold at its largest: prompt + the larger of generated and expected output."""
        return self.prompt_tokens + max(float(self.generated_tokens), self.expected_output_tokens)

    @property
    def remaining_s(self) -> float:
        """Predicted seconds until it finishes: remaining expected output x its TPOT (>= 0)."""
        return max(0.0, self.expected_output_tokens - self.generated_tokens) * self.predicted_tpot_s


class ClassLoad:
    """One class's streams on one replica (seconds, tokens). Independent of the class's targets,
    which the admitter reads from the settings in force. Immutable once built.

    ``seqs``: its streams. ``kv_tokens``: their projected KV tokens.
    ``max_tpot_s``: the largest predicted TPOT among them (the stream closest to its target).
    ``streams``: (TPOT, predicted remaining seconds, projected KV tokens) per known stream; the
    sorted tables behind the ``wait_*`` estimates are built from them on first use (O(k log k)),
    since only a request that is held back needs them.
    ``decodes``: (decode intervals so far, seconds they took, expected remaining output tokens)
    per stream, newly admitted ones included: what ``min_stall_budget_s`` needs.
    """

    __slots__ = (
        "_budgets",
        "_by_finish",
        "_by_tpot",
        "decodes",
        "kv_tokens",
        "max_tpot_s",
        "seqs",
        "streams",
    )

    def __init__(
        self,
        seqs: int,
        kv_tokens: float,
        max_tpot_s: float,
        streams: tuple[tuple[float, float, float], ...] = (),
        decodes: tuple[tuple[float, float, float], ...] = (),
    ) -> None:
        self.seqs = seqs
        self.kv_tokens = kv_tokens
        self.max_tpot_s = max_tpot_s
        self.streams = streams
        self.decodes = decodes
        self._by_tpot: tuple[tuple[float, ...], tuple[float, ...]] | None = None
        self._by_finish: tuple[tuple[float, ...], tuple[float, ...]] | None = None
        self._budgets: dict[tuple[float, float, float], float] | None = None

    def __repr__(self) -> str:
        return f"ClassLoad(seqs={self.seqs}, kv_tokens={self.kv_tokens}, max_tpot_s={self.max_tpot_s})"

    @property
    def finish_s(self) -> tuple[float, ...]:
        """Predicted remaining seconds of its known streams, ascending."""
        return self._finish_table()[0]

    @property
    def max_finish_s(self) -> float:
        """Predicted seconds until all of its (known) streams have finished."""
        finish = self.finish_s
        return finish[-1] if finish else 0.0

    def with_stream(self, kv_tokens: float, tpot_s: float, output_tokens: float = 1.0) -> ClassLoad:
        """This load plus one newly admitted stream of ``output_tokens`` expected output (the wait
        estimates keep the known streams only)."""
        return ClassLoad(
            self.seqs + 1,
            self.kv_tokens + kv_tokens,
            max(self.max_tpot_s, tpot_s),
            self.streams,
            (*self.decodes, (0.0, 0.0, output_tokens)),
        )

    def min_stall_budget_s(self, tpot_target_s: float, horizon: float, step_s: float) -> float:
        """The smallest **stall budget** among its streams that can still meet ``tpot_target_s``:
        the extra decode pause, in seconds, a stream can absorb and still end at a mean TPOT within
        the target; ``inf`` when no stream can (none, or all already past saving).

        A stream that took ``e`` seconds for ``d`` decode intervals so far and is assumed to run
        ``r`` more decode steps of ``step_s`` seconds (the replica's decode step without prefill)
        ends at mean TPOT ``(e + r x step_s + stall) / (d + r)``, so its budget is
        ``target x (d + r) - e - r x step_s``. ``r`` is ``horizon`` (0-1] times its expected
        remaining output, at least 1: a stream may end sooner than expected, and a short stream has
        little room. A stream whose budget is already negative will miss whatever is admitted,
        so it does not hold newcomers back. O(k) once per (target, horizon, step), then O(1).
        """
        key = (tpot_target_s, horizon, step_s)
        memo = self._budgets
        if memo is None:
            memo = self._budgets = {}
        found = memo.get(key)
        if found is not None:
            return found
        least = math.inf
        room = tpot_target_s - step_s
        for done, elapsed, remaining in self.decodes:
            rest = horizon * remaining
            if rest < 1.0:
                rest = 1.0
            budget = tpot_target_s * done - elapsed + rest * room
            if 0.0 <= budget < least:
                least = budget
        if len(memo) >= 16:
            memo.clear()
        memo[key] = least
        return least

    def _tpot_table(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(TPOTs ascending, latest finish among the streams from each position on)."""
        if self._by_tpot is None:
            ordered = sorted(self.streams)
            suffix: list[float] = []
            latest = 0.0
            for _, finish, _ in reversed(ordered):
                latest = max(latest, finish)
                suffix.append(latest)
            suffix.reverse()
            self._by_tpot = (tuple(t for t, _, _ in ordered), tuple(suffix))
        return self._by_tpot

    def _finish_table(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(remaining seconds ascending, projected KV freed once the first i + 1 have finished)."""
        if self._by_finish is None:
            ordered = sorted((finish, kv) for _, finish, kv in self.streams)
            cumulative: list[float] = []
            freed = 0.0
            for _, kv in ordered:
                freed += kv
                cumulative.append(freed)
            self._by_finish = (tuple(f for f, _ in ordered), tuple(cumulative))
        return self._by_finish

    def wait_for_tpot_below_s(self, limit_s: float) -> float:
        """Seconds until every stream predicted above ``limit_s`` per token has finished (0 if none)."""
        tpots, finish_from = self._tpot_table()
        i = bisect.bisect_right(tpots, limit_s)
        return finish_from[i] if i < len(finish_from) else 0.0

    def wait_for_kv_s(self, tokens: float) -> float:
        """Seconds until its streams have freed ``tokens`` projected KV tokens (all of them if fewer)."""
        finish, freed = self._finish_table()
        if tokens <= 0.0 or not finish:
            return 0.0
        return finish[min(bisect.bisect_left(freed, tokens), len(finish) - 1)]

    def wait_for_finishes_s(self, count: int) -> float:
        """Seconds until ``count`` of its streams have finished (all of them if fewer)."""
        finish = self.finish_s
        if count <= 0 or not finish:
            return 0.0
        return finish[min(count, len(finish)) - 1]


#: The load of a class with no stream on a replica.
EMPTY_LOAD: Final = ClassLoad(0, 0.0, 0.0)


def class_load(streams: Iterable[StreamingRequest], step_s: float = 0.0) -> ClassLoad:
    """Aggregate one class's streams in one pass (O(k); the wait tables are built lazily).

    ``step_s``: the replica's current decode step time; a stream's TPOT from now on is at least
    that, whatever was predicted when it was admitted (others joined since).
    """
    items: list[tuple[float, float, float]] = []
    decodes: list[tuple[float, float, float]] = []
    kv = 0.0
    worst = 0.0
    for s in streams:
        tpot = s.predicted_tpot_s if s.predicted_tpot_s > step_s else step_s
        expected = s.expected_output_tokens
        generated = float(s.generated_tokens)
        remaining = (expected - generated) * tpot if expected > generated else 0.0
        footprint = s.prompt_tokens + (expected if expected > generated else generated)
        kv += footprint
        worst = tpot if tpot > worst else worst
        items.append((tpot, remaining, footprint))
        done = generated - 1.0 if generated > 1.0 else 0.0
        elapsed = s.decode_elapsed_s if s.decode_elapsed_s is not None else done * s.predicted_tpot_s
        decodes.append((done, elapsed, expected - generated if expected > generated else 0.0))
    if not items:
        return EMPTY_LOAD
    return ClassLoad(len(items), kv, worst, tuple(items), tuple(decodes))


def class_loads(streams: Iterable[StreamingRequest], step_s: float = 0.0) -> dict[str, ClassLoad]:
    """Per-class loads of ``streams`` (see ``class_load``)."""
    grouped: dict[str, list[StreamingRequest]] = {}
    for s in streams:
        grouped.setdefault(s.request_class, []).append(s)
    return {name: class_load(items, step_s) for name, items in grouped.items()}


def decode_slot_capacity(
    model: StepModel, state: ReplicaState, tpot_target_s: float, context_tokens: float
) -> int:
    """Decode slots of a replica: the largest decode batch whose step meets ``tpot_target_s``.

    Each sequence is assumed to read ``context_tokens`` KV tokens. The step model is piecewise
    linear in the batch size (one knee), so this solves two linear inequalities. Capped by
    ``max_num_seqs``; ``max_num_seqs`` itself when the model is not valid; at least 1.
    """
    cap = state.max_num_seqs
    if not model.valid:
        return max(1, cap)
    p = model.params
    per_seq = p.per_decode_seq_s + p.per_kv_token_s * context_tokens
    room = tpot_target_s - p.base_s
    if room <= 0.0:
        return 1
    below = per_seq + p.per_token_s
    n = room / below if below > 0.0 else math.inf
    if n > p.knee_tokens:
        above = per_seq + p.per_compute_token_s
        spare = room - below * p.knee_tokens
        n = p.knee_tokens + spare / above if above > 0.0 else math.inf
    if not math.isfinite(n):
        return max(1, cap)
    return max(1, min(cap, math.floor(n)))


def kv_share_limit(kv_share: float, state: ReplicaState) -> float:
    """Projected KV tokens a class with ``kv_share`` may hold on the replica."""
    return kv_share * state.kv_capacity_tokens


def slot_share_limit(slot_share: float, decode_slots: int) -> int:
    """Decode slots a class with ``slot_share`` may hold on a replica with ``decode_slots`` (>= 1)."""
    return max(1, math.floor(slot_share * decode_slots))
