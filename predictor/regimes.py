"""The load regimes a replica's measured forecast correction is kept by (``predictor.correction``).

A regime is a request's prompt size and its load: for TPOT the decodes its prefill joins
(``regime``), for TTFT how it reaches the engine (``ttft_regime``: an idle engine, a free slot,
or a wait for a slot behind at most one engine-full of requests, or more). Sixteen of each,
indexed ``prompt bin x N_BATCH + load bin``; ``regime_label`` / ``ttft_regime_label`` name them
for reports. Pure functions of their arguments.
"""

from __future__ import annotations

import bisect
from typing import Final

__all__ = [
    "BATCH_EDGES",
    "N_BATCH",
    "N_REGIMES",
    "PROMPT_EDGES",
    "regime",
    "regime_label",
    "ttft_load",
    "ttft_regime",
    "ttft_regime_label",
]

#: Prompt-size bins (tokens): below 256, 256-1023, 1024-4095, 4096 and more. Tokenisation and
#: prefill grow with the prompt; an API server's per-request work does not, so the ratio differs.
PROMPT_EDGES: Final = (256, 1024, 4096)
#: Batch bins (decode sequences the request joins): 0 (idle), 1-3, 4-15, 16 and more. The host's
#: contention grows with the streams it relays.
BATCH_EDGES: Final = (1, 4, 16)
#: Load bins per prompt bin (TPOT's batch bins; TTFT's ``_TTFT_LOADS``, as many).
N_BATCH: Final = len(BATCH_EDGES) + 1
#: Regimes of each latency.
N_REGIMES: Final = (len(PROMPT_EDGES) + 1) * N_BATCH
#: TTFT's load bins (``ttft_regime``): an idle engine, a busy one with a free slot, a wait for a
#: slot behind at most one engine-full of requests, and behind more.
_TTFT_LOADS: Final = ("idle", "free-slot", "slot-wait<=1", "slot-wait>1")


def regime(prompt_tokens: float, decode_seqs: float) -> int:
    """The TPOT load regime (0 .. 15) of a request of ``prompt_tokens`` joining ``decode_seqs`` decodes."""
    p = bisect.bisect_right(PROMPT_EDGES, prompt_tokens)
    b = bisect.bisect_right(BATCH_EDGES, decode_seqs)
    return p * N_BATCH + b


def regime_label(index: int) -> str:
    """A TPOT regime's name for reports: ``prompt<256,batch=0``-style."""
    p, b = divmod(index, N_BATCH)
    return f"prompt{_bin(PROMPT_EDGES, p)},batch{_bin(BATCH_EDGES, b)}"


def ttft_regime(prompt_tokens: float, decode_seqs: float, slot_waves: float) -> int:
    """The TTFT load regime (0 .. 15) of a request of ``prompt_tokens`` whose prefill joins
    ``decode_seqs`` decodes behind ``slot_waves`` engine-fulls of requests that must leave before
    it has a slot (``Forecast.slot_waves``): idle (no decode, no wait), a free slot (no wait), or
    a wait behind at most one engine-full (``max_num_seqs``) or more."""
    return bisect.bisect_right(PROMPT_EDGES, prompt_tokens) * N_BATCH + ttft_load(decode_seqs, slot_waves)


def ttft_load(decode_seqs: float, slot_waves: float) -> int:
    """``ttft_regime``'s load bin (0 .. 3: idle, free slot, a wait behind at most one
    engine-full, behind more)."""
    if slot_waves > 0.0:
        return 3 if slot_waves > 1.0 else 2
    return 1 if decode_seqs > 0.0 else 0


def ttft_regime_label(index: int) -> str:
    """A TTFT regime's name for reports: ``prompt<256,slot-wait>1``-style."""
    p, b = divmod(index, N_BATCH)
    return f"prompt{_bin(PROMPT_EDGES, p)},{_TTFT_LOADS[b]}"


def _bin(edges: tuple[int, ...], i: int) -> str:
    if i == 0:
        return f"<{edges[0]}" if edges[0] > 1 else "=0"
    if i == len(edges):
        return f">={edges[-1]}"
    return f"{edges[i - 1]}-{edges[i] - 1}"
