"""Traces for the replay: real arrivals and token counts, loaded and re-timed (pure, no engine).

Arrivals are seconds from the trace's start; every function returns a new list in arrival order.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final

__all__ = [
    "AZURE_CONV_TRACE",
    "MOONCAKE_CONV_TRACE",
    "TraceRequest",
    "at_rate",
    "fit_to_model_len",
    "load_azure_trace",
    "load_mooncake_trace",
    "parse_hash_ids",
    "piecewise_rate",
]

#: The Azure LLM inference trace 2023 (conversation), copied with its licence (see its README).
AZURE_CONV_TRACE: Final = (
    Path(__file__).resolve().parents[1]
    / "tests"
    / "data"
    / "traces"
    / "azure_llm_2023"
    / "AzureLLMInferenceTrace_conv.csv"
)

#: The Mooncake FAST'25 conversation trace (Kimi) as CSV: its three numeric columns and its prefix
#: block ids (see its README).
MOONCAKE_CONV_TRACE: Final = AZURE_CONV_TRACE.parents[1] / "mooncake_fast25" / "conversation_trace.csv"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival (seconds from the trace's start) and its token counts.

    ``hash_ids``: its prompt's prefix blocks as the trace names them (Mooncake's ``hash_ids``: one
    id per ``replay.prefixes.HASH_BLOCK_TOKENS`` tokens, the last block possibly partial; two
    requests share their prompts' first k blocks exactly when their first k ids are equal);
    ``None``: the trace says nothing of shared prefixes.
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None

    def at(self, arrival_s: float) -> TraceRequest:
        """The same request arriving at ``arrival_s``."""
        return dataclasses.replace(self, arrival_s=arrival_s)


def load_azure_trace(
    path: Path = AZURE_CONV_TRACE, *, start: int = 0, count: int | None = None
) -> list[TraceRequest]:
    """Rows ``start`` .. ``start + count`` of an Azure LLM trace CSV, arrivals relative to the first.

    Timestamps carry 7 fractional digits, which ``datetime.fromisoformat`` of Python 3.11 reads.
    """
    rows: list[tuple[datetime, int, int]] = []
    with path.open(newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < start:
                continue
            if count is not None and len(rows) >= count:
                break
            rows.append(
                (
                    datetime.fromisoformat(row["TIMESTAMP"]),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                )
            )
    if not rows:
        return []
    t0 = rows[0][0]
    return [TraceRequest((t - t0).total_seconds(), p, o) for t, p, o in rows]


def parse_hash_ids(text: str) -> tuple[int, ...]:
    """The block ids of the CSV's ``hash_ids`` column: space-separated ids and inclusive runs
    ``a-b`` (``"0 14-17"`` is ``(0, 14, 15, 16, 17)``); ``ValueError`` on anything else."""
    ids: list[int] = []
    for part in text.split():
        first, dash, last = part.partition("-")
        if not dash:
            ids.append(int(first))
            continue
        a, b = int(first), int(last)
        if b < a:
            raise ValueError(f"descending run {part!r} in hash_ids")
        ids.extend(range(a, b + 1))
    return tuple(ids)


def load_mooncake_trace(
    path: Path = MOONCAKE_CONV_TRACE, *, start: int = 0, count: int | None = None, spread: bool = True
) -> list[TraceRequest]:
    """Rows ``start`` .. ``start + count`` of the Mooncake conversation trace CSV
    (``timestamp_ms,input_length,output_length``, and ``hash_ids`` where the file has it, see
    ``parse_hash_ids``), arrivals in seconds relative to the first row.

    The trace's timestamps are quantised to 3-second slots (every request of a slot has the same
    one). ``spread``: requests sharing a timestamp are spread evenly over the gap to the next
    distinct timestamp (request j of n at ``t + gap x j / n``), which is milder than replaying
    each slot as one simultaneous burst; the slot's last gap is taken as the previous one.
    """
    rows: list[TraceRequest] = []
    with path.open(newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < start:
                continue
            if count is not None and len(rows) >= count:
                break
            ids = row.get("hash_ids")
            rows.append(
                TraceRequest(
                    float(row["timestamp_ms"]) / 1e3,
                    int(row["input_length"]),
                    int(row["output_length"]),
                    None if ids is None else parse_hash_ids(ids),
                )
            )
    if not rows:
        return []
    times = [r.arrival_s for r in rows]
    if spread:
        distinct = sorted(set(times))
        gaps = {a: b - a for a, b in itertools.pairwise(distinct)}
        last_gap = gaps[distinct[-2]] if len(distinct) > 1 else 0.0
        groups: dict[float, int] = {}
        for t in times:
            groups[t] = groups.get(t, 0) + 1
        seen: dict[float, int] = {}
        spread_times: list[float] = []
        for t in times:
            j = seen.get(t, 0)
            seen[t] = j + 1
            spread_times.append(t + gaps.get(t, last_gap) * j / groups[t])
        times = spread_times
    t0 = min(times)
    order = sorted(range(len(rows)), key=lambda k: (times[k], k))
    return [rows[k].at(times[k] - t0) for k in order]


def piecewise_rate(
    requests: Sequence[TraceRequest], phases: Sequence[tuple[float, float]]
) -> list[TraceRequest]:
    """The requests, in order, re-timed to run ``phases`` back to back: each ``(duration_s,
    rate_per_s)`` phase takes the next ``ceil(duration x rate)`` requests and compresses their
    gaps by one factor to that mean rate (as ``at_rate``), so each phase keeps the trace's burst
    shape. Stops early when the requests run out.
    """
    out: list[TraceRequest] = []
    offset, used = 0.0, 0
    for duration, rate in phases:
        if duration <= 0 or rate <= 0:
            raise ValueError(f"phases need duration and rate > 0, got {(duration, rate)}")
        n = math.ceil(duration * rate)
        chunk = list(requests[used : used + n + 1])  # one more: its arrival ends the phase
        if not chunk:
            break
        timed = at_rate(chunk, rate) if len(chunk) > 1 else [chunk[0].at(0.0)]
        scale = duration / timed[-1].arrival_s if len(timed) == n + 1 and timed[-1].arrival_s > 0 else 1.0
        for r in timed[:n]:
            t = offset + r.arrival_s * scale
            if t < offset + duration:
                out.append(r.at(t))
        used += n
        offset += duration
    return out


def at_rate(requests: Sequence[TraceRequest], rate_per_s: float) -> list[TraceRequest]:
    """The same requests with time compressed (or stretched) to a mean rate of ``rate_per_s``.

    Every gap is scaled by one factor, so the trace's burst shape is kept (see the traces README:
    compressing time keeps the shape, superimposing copies would smooth it).
    """
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    if len(requests) < 2:
        return list(requests)
    span = requests[-1].arrival_s - requests[0].arrival_s
    native = (len(requests) - 1) / span if span > 0 else rate_per_s
    scale = native / rate_per_s
    t0 = requests[0].arrival_s
    return [r.at((r.arrival_s - t0) * scale) for r in requests]


def fit_to_model_len(requests: Sequence[TraceRequest], max_model_len: int) -> tuple[list[TraceRequest], int]:
    """(requests whose prompt + output fit ``max_model_len``, how many did not).

    A real engine answers 400 to the others; they never reach a step, so the replay counts them
    and leaves them out rather than truncating them silently.
    """
    kept = [r for r in requests if r.prompt_tokens + r.output_tokens <= max_model_len]
    return kept, len(requests) - len(kept)
