"""The workload a plan is made for: a trace file the replay reads, or a synthetic Poisson stream.

``load_workload`` reads the Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,
GeneratedTokens``) or the Mooncake CSV (``timestamp_ms,input_length,output_length``), told apart by
the header; ``synthetic_workload`` draws Poisson arrivals at a rate with prompt and output lengths
from ``LengthDist``s. Either is then sliced in time, optionally re-timed to a mean rate (the
trace's burst shape kept: ``replay.at_rate``), and cut to the profile's ``max_model_len`` (requests
that do not fit are counted, not truncated). Pure apart from reading the file.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from replay.traces import TraceRequest, at_rate, fit_to_model_len, load_azure_trace, load_mooncake_trace

__all__ = ["LengthDist", "Workload", "load_workload", "parse_length_dist", "read_trace", "synthetic_workload"]


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token-length distribution: ``const`` (``a``), ``uniform`` (integers ``a..b``) or
    ``lognormal`` (median ``a``, log-space standard deviation ``b``). Draws are at least 1."""

    kind: str
    a: float
    b: float = 0.0

    def draw(self, rng: random.Random) -> int:
        """One length, tokens (>= 1)."""
        if self.kind == "const":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        else:
            value = self.a * math.exp(self.b * rng.gauss(0.0, 1.0))
        return max(1, round(value))

    def describe(self) -> str:
        if self.kind == "const":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def parse_length_dist(text: str) -> LengthDist:
    """``"512"`` (constant), ``"uniform:LO:HI"`` or ``"lognormal:MEDIAN:SIGMA"``; ``ValueError``
    with the accepted forms otherwise."""
    parts = text.strip().split(":")
    try:
        if len(parts) == 1 and float(parts[0]) >= 1:
            return LengthDist("const", float(parts[0]))
        if len(parts) == 3 and parts[0] == "uniform":
            lo, hi = int(parts[1]), int(parts[2])
            if 1 <= lo <= hi:
                return LengthDist("uniform", lo, hi)
        if len(parts) == 3 and parts[0] == "lognormal":
            median, sigma = float(parts[1]), float(parts[2])
            if median >= 1 and sigma >= 0:
                return LengthDist("lognormal", median, sigma)
    except ValueError:
        pass
    raise ValueError(
        f"length distribution {text!r}: expected N (constant, >= 1), uniform:LO:HI (1 <= LO <= HI) "
        "or lognormal:MEDIAN:SIGMA (MEDIAN >= 1, SIGMA >= 0)"
    )


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests in arrival order (seconds from the first) and what they came from.

    ``source``: one line for the report. ``too_long``: requests left out because prompt + output
    exceed ``max_model_len``. ``duration_s``: the span the arrivals cover (for rates).
    """

    requests: tuple[TraceRequest, ...]
    source: str
    duration_s: float
    too_long: int = 0

    @property
    def rate_per_s(self) -> float:
        """Mean arrivals per second over ``duration_s`` (0.0 when empty)."""
        return len(self.requests) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def mean_prompt_tokens(self) -> float:
        return statistics.fmean(r.prompt_tokens for r in self.requests) if self.requests else 0.0

    @property
    def mean_output_tokens(self) -> float:
        return statistics.fmean(r.output_tokens for r in self.requests) if self.requests else 0.0

    def pairs(self) -> list[tuple[int, int]]:
        """``(prompt, output)`` tokens of every request."""
        return [(r.prompt_tokens, r.output_tokens) for r in self.requests]


def synthetic_workload(
    rate_per_s: float, prompt: LengthDist, output: LengthDist, duration_s: float, *, seed: int = 0
) -> list[TraceRequest]:
    """Poisson arrivals at ``rate_per_s`` for ``duration_s`` seconds, lengths drawn from
    ``prompt`` and ``output``; deterministic for a seed."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError("rate_per_s and duration_s must be > 0")
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    t = rng.expovariate(rate_per_s)
    while t < duration_s:
        out.append(TraceRequest(t, prompt.draw(rng), output.draw(rng)))
        t += rng.expovariate(rate_per_s)
    return out


def read_trace(path: Path) -> list[TraceRequest]:
    """Every request of a trace CSV, Azure or Mooncake format (told apart by the header)."""
    try:
        with path.open(encoding="utf-8") as f:
            header = f.readline().strip()
    except OSError as exc:
        raise ValueError(f"trace {path}: {exc}") from exc
    if header.startswith("TIMESTAMP"):
        return load_azure_trace(path)
    if header.startswith("timestamp_ms"):
        return load_mooncake_trace(path)
    raise ValueError(
        f"trace {path}: unknown format (header {header[:60]!r}); expected the Azure LLM trace "
        "(TIMESTAMP,ContextTokens,GeneratedTokens) or Mooncake (timestamp_ms,input_length,output_length)"
    )


def load_workload(
    requests: Sequence[TraceRequest],
    source: str,
    max_model_len: int,
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    rate_per_s: float | None = None,
) -> Workload:
    """The requests arriving in ``[start_s, start_s + duration_s)`` (``None``: to the end), re-based
    to 0, re-timed to ``rate_per_s`` if given (gaps scaled by one factor), then cut to
    ``max_model_len``. ``ValueError`` when nothing is left."""
    end = math.inf if duration_s is None else start_s + duration_s
    window = [r for r in requests if start_s <= r.arrival_s < end]
    if not window:
        raise ValueError(f"{source}: no request arrives in the chosen time slice")
    t0 = window[0].arrival_s
    rebased = [TraceRequest(r.arrival_s - t0, r.prompt_tokens, r.output_tokens) for r in window]
    span = duration_s if duration_s is not None else rebased[-1].arrival_s
    if rate_per_s is not None:
        rebased = at_rate(rebased, rate_per_s)
        span = len(rebased) / rate_per_s
    kept, too_long = fit_to_model_len(rebased, max_model_len)
    if not kept:
        raise ValueError(f"{source}: no request fits max_model_len {max_model_len}")
    return Workload(tuple(kept), source, max(span, kept[-1].arrival_s), too_long)
