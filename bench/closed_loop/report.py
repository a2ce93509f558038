"""The closed-loop bench's figures per point, its verdicts, and their markdown.

Per point (one trace, one load, one path) over the requests sent in it:

* **good req/s** and **good tokens/s**: requests that met both targets (``Outcome.met``), and
  their prompt + output tokens, per second of sending;
* **refused**: share answered 429 (Sluice's refusals; 0 on the direct path);
* **admitted attainment** (Sluice): met / admitted, where admitted is every request not refused
  (an error, or an answer still missing when the point ended, counts as admitted and missed);
* **admission by prompt-size quartile** (Sluice): admitted / offered per quartile of the scaled
  trace's prompt sizes (``bench.goodput.metrics.prompt_quartile_edges`` of the trace's requests);
* **bursts**: share of the streams of two tokens or more whose tokens all reached the client at
  once (TPOT under ``BURST_TPOT_S``: the engine's API server or the gateway starved of CPU, its
  socket holding several tokens when it ran), whose client TPOT says nothing of the engine's;
* **forecast errors, as the client sees them**: per admitted request with Sluice's forecast
  headers and a measurement, ``forecast / measured - 1`` (the headers carry the forecast admission
  used: corrected, its margin included; the client's TTFT adds the gateway's relay; bursts are
  left out of TPOT's);
* **forecast errors, as the gateway measured them, before and after the correction**: the
  residuals ``GET /sluice/v1/replicas`` reports per replica (``predictor.correction.Residuals``:
  the last 60 s of finished requests, the step model's own forecast against the gateway's
  dispatch -> first token and TPOT), their signed medians turned into ``forecast / measured - 1``
  (a monotone map of the gateway's ``measured / forecast - 1``), their p90 of the absolute error
  as the gateway gives it (``|measured / forecast - 1|``).

Targets (``verdicts``), judged by ``bench.verdicts``' rules (a missing figure is not met):
admitted attainment >= 95 % at every load; at 0.5x no more than 2 % refused; good tokens/s at 2x
and 4x >= 90 % of the best direct point; the signed median TTFT and TPOT errors after the
correction within +-15 % at every load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from bench.closed_loop.client import Outcome
from bench.goodput.metrics import prompt_quartile
from bench.predictor_accuracy_vllm import BURST_TPOT_S
from bench.verdicts import Verdict, judge, missing
from replay import Targets

__all__ = [
    "FULL_LOADS",
    "Errors",
    "GatewayErrors",
    "PathStats",
    "Point",
    "correction_of",
    "gateway_errors",
    "header_errors",
    "path_stats",
    "render",
    "verdicts",
]

#: The loads (multiples of the direct engine's capacity) the targets name.
FULL_LOADS: Final = (0.5, 1.0, 2.0, 4.0)
ATTAINMENT_TARGET: Final = 0.95
LOW_LOAD: Final = 0.5
LOW_LOAD_MAX_REFUSED: Final = 0.02
OVERLOADS: Final = (2.0, 4.0)
GOODPUT_SHARE: Final = 0.90
MAX_MEDIAN_ERROR: Final = 0.15


@dataclass(frozen=True, slots=True)
class Errors:
    """Relative errors ``forecast / measured - 1`` of ``n`` requests: the signed median and the
    90th percentile of the absolute value; ``None`` without a request."""

    n: int
    median: float | None
    p90_abs: float | None


def _errors(pairs: Sequence[tuple[float, float]]) -> Errors:
    ratios = np.array([f / m - 1.0 for f, m in pairs if m > 0 and math.isfinite(f)])
    if ratios.size == 0:
        return Errors(0, None, None)
    return Errors(int(ratios.size), float(np.median(ratios)), float(np.quantile(np.abs(ratios), 0.9)))


def _burst(o: Outcome) -> bool:
    return o.tpot_s is not None and o.tpot_s < BURST_TPOT_S


def header_errors(outcomes: Sequence[Outcome]) -> dict[str, Errors]:
    """``{"ttft": ..., "tpot": ...}``: Sluice's forecast headers against the client's measurement,
    over the answers that carried them (TPOT: answers of two tokens or more, bursts left out)."""
    ok = [o for o in outcomes if o.status == 200]
    ttft = [
        (o.predicted_ttft_s, o.ttft_s) for o in ok if o.predicted_ttft_s is not None and o.ttft_s is not None
    ]
    tpot = [
        (o.predicted_tpot_s, o.tpot_s)
        for o in ok
        if o.predicted_tpot_s is not None and o.tpot_s is not None and not _burst(o)
    ]
    return {"ttft": _errors(ttft), "tpot": _errors(tpot)}


@dataclass(frozen=True, slots=True)
class GatewayErrors:
    """One latency's residuals on the replica as ``GET /sluice/v1/replicas`` gave them at the end
    of a point: ``samples`` in its window, the signed medians before and after the correction as
    ``forecast / measured - 1``, the p90 of ``|measured / forecast - 1|`` before and after, and the
    replica-wide correction factor then. ``None``: the gateway had no sample."""

    samples: int
    before_median: float | None
    after_median: float | None
    before_p90_abs: float | None
    after_p90_abs: float | None
    factor: float | None


def _forecast_over_measured(residual: object) -> float | None:
    """``forecast / measured - 1`` of a residual ``measured / forecast - 1`` (``None`` stays)."""
    if not isinstance(residual, int | float) or residual <= -1.0:
        return None
    return 1.0 / (1.0 + float(residual)) - 1.0


def _number(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def correction_of(view: Mapping[str, Any], replica: str) -> Mapping[str, Any]:
    """The admin view's (``GET /sluice/v1/replicas``) ``prediction.replicas[replica].correction``;
    empty when it has none."""
    prediction = view.get("prediction") or {}
    return ((prediction.get("replicas") or {}).get(replica) or {}).get("correction") or {}


def gateway_errors(view: Mapping[str, Any], replica: str) -> dict[str, GatewayErrors]:
    """``{"ttft": ..., "tpot": ...}`` from the admin view's correction of ``replica``
    (``correction_of``); no samples when the view has no such replica or correction."""
    out = {}
    correction = correction_of(view, replica)
    for name in ("ttft", "tpot"):
        latency = correction.get(name) or {}
        r = latency.get("residuals") or {}
        out[name] = GatewayErrors(
            samples=int(r.get("samples") or 0),
            before_median=_forecast_over_measured(r.get("before_median")),
            after_median=_forecast_over_measured(r.get("after_median")),
            before_p90_abs=_number(r.get("before_p90_abs")),
            after_p90_abs=_number(r.get("after_p90_abs")),
            factor=_number(latency.get("factor")),
        )
    return out


@dataclass(frozen=True, slots=True)
class PathStats:
    """One path's counts at one point (``path_stats``); rates per second of ``duration_s``.

    ``quartile_offered`` / ``quartile_admitted``: per prompt-size quartile, shortest first.
    ``ttft_p50_s`` / ``ttft_p90_s``: the client's TTFT over the answers that had a first token.
    ``streams`` / ``bursts``: answers of two tokens or more, and those that came in one burst.
    """

    offered: int
    refused: int
    errors: int
    unanswered: int
    met: int
    met_tokens: int
    duration_s: float
    quartile_offered: tuple[int, int, int, int]
    quartile_admitted: tuple[int, int, int, int]
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    streams: int = 0
    bursts: int = 0

    @property
    def admitted(self) -> int:
        return self.offered - self.refused

    @property
    def good_per_s(self) -> float:
        return self.met / self.duration_s

    @property
    def good_tokens_per_s(self) -> float:
        return self.met_tokens / self.duration_s

    @property
    def refused_share(self) -> float:
        """refused / offered, 0-1; NaN without a request."""
        return self.refused / self.offered if self.offered else math.nan

    @property
    def admitted_attainment(self) -> float:
        """met / admitted, 0-1; NaN when nothing was admitted."""
        return self.met / self.admitted if self.admitted else math.nan

    @property
    def quartile_rates(self) -> tuple[float, ...]:
        """admitted / offered per quartile, NaN for an empty one."""
        return tuple(
            a / o if o else math.nan
            for a, o in zip(self.quartile_admitted, self.quartile_offered, strict=True)
        )


def path_stats(
    outcomes: Sequence[Outcome], targets: Targets, duration_s: float, edges: tuple[int, int, int]
) -> PathStats:
    """The counts of one path's ``outcomes`` over ``duration_s`` seconds of sending; ``edges``:
    the trace's prompt-size quartile edges."""
    offered, admitted = [0] * 4, [0] * 4
    for o in outcomes:
        k = prompt_quartile(o.prompt_tokens, edges)
        offered[k] += 1
        admitted[k] += o.status != 429
    met = [o for o in outcomes if o.met(targets)]
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    return PathStats(
        offered=len(outcomes),
        refused=sum(o.status == 429 for o in outcomes),
        errors=sum(o.status is not None and o.status not in (200, 429) for o in outcomes),
        unanswered=sum(o.status is None for o in outcomes),
        met=len(met),
        met_tokens=sum(o.prompt_tokens + o.tokens for o in met),
        duration_s=duration_s,
        quartile_offered=(offered[0], offered[1], offered[2], offered[3]),
        quartile_admitted=(admitted[0], admitted[1], admitted[2], admitted[3]),
        ttft_p50_s=float(np.quantile(ttfts, 0.5)) if ttfts else None,
        ttft_p90_s=float(np.quantile(ttfts, 0.9)) if ttfts else None,
        streams=sum(o.tpot_s is not None for o in outcomes),
        bursts=sum(_burst(o) for o in outcomes),
    )


@dataclass(frozen=True, slots=True)
class Point:
    """One trace, one load, one path: its offered rate, its counts and, through Sluice, its
    forecast errors (client and gateway side)."""

    trace: str
    load: float
    path: str
    rate_per_s: float
    stats: PathStats
    header: Mapping[str, Errors] | None = None
    gateway: Mapping[str, GatewayErrors] | None = None


def _find(points: Sequence[Point], trace: str, load: float, path: str) -> Point | None:
    return next((p for p in points if p.trace == trace and p.load == load and p.path == path), None)


def verdicts(points: Sequence[Point], traces: Sequence[str]) -> list[Verdict]:
    """Every target for every trace in ``traces`` at ``FULL_LOADS``; a point not run, or a figure
    it lacks, is ``not met (no data)``."""
    out: list[Verdict] = []
    for trace in traces:
        for load in FULL_LOADS:
            target = f"{trace}, {load:g}x: admitted attainment >= {ATTAINMENT_TARGET:.0%}"
            p = _find(points, trace, load, "sluice")
            if p is None or not p.stats.admitted:
                out.append(missing(target, "no point run" if p is None else "nothing admitted"))
            else:
                a = p.stats.admitted_attainment
                out.append(
                    judge(target, a, a >= ATTAINMENT_TARGET, f"{p.stats.met} of {p.stats.admitted} ({a:.1%})")
                )
        target = f"{trace}, {LOW_LOAD:g}x: refused <= {LOW_LOAD_MAX_REFUSED:.0%}"
        p = _find(points, trace, LOW_LOAD, "sluice")
        if p is None or not p.stats.offered:
            out.append(missing(target, "no point run"))
        else:
            r = p.stats.refused_share
            out.append(
                judge(
                    target, r, r <= LOW_LOAD_MAX_REFUSED, f"{p.stats.refused} of {p.stats.offered} ({r:.1%})"
                )
            )
        direct = [p.stats.good_tokens_per_s for p in points if p.trace == trace and p.path == "direct"]
        best = max(direct, default=0.0)
        for load in OVERLOADS:
            target = (
                f"{trace}, {load:g}x: Sluice's good tokens/s >= {GOODPUT_SHARE:.0%} of the best direct point"
            )
            p = _find(points, trace, load, "sluice")
            if p is None:
                out.append(missing(target, "no point run"))
            elif best <= 0:
                out.append(missing(target, "no direct point with good tokens"))
            else:
                share = p.stats.good_tokens_per_s / best
                detail = f"{p.stats.good_tokens_per_s:.0f} vs {best:.0f} tokens/s ({share:.0%})"
                out.append(judge(target, share, share >= GOODPUT_SHARE, detail))
        for load in FULL_LOADS:
            for metric in ("ttft", "tpot"):
                target = (
                    f"{trace}, {load:g}x: signed median {metric.upper()} error after the correction "
                    f"within +-{MAX_MEDIAN_ERROR:.0%}"
                )
                p = _find(points, trace, load, "sluice")
                g = None if p is None or p.gateway is None else p.gateway[metric]
                if g is None or g.after_median is None:
                    out.append(
                        missing(target, "no point run" if p is None else "the gateway had no residual")
                    )
                else:
                    e = g.after_median
                    detail = f"{e:+.1%} over {g.samples} requests"
                    out.append(judge(target, e, abs(e) <= MAX_MEDIAN_ERROR, detail))
    return out


# -- markdown -----------------------------------------------------------------------------------------


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None or math.isnan(x):
        return "—"
    return f"{x:+.0%}" if signed else f"{x:.0%}"


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _err(e: Errors | None) -> str:
    return "—" if e is None or e.n == 0 else f"{_pct(e.median, True)} / {_pct(e.p90_abs)}"


def _gw(g: GatewayErrors | None) -> str:
    if g is None or g.samples == 0:
        return "—"
    return (
        f"{_pct(g.before_median, True)} → {_pct(g.after_median, True)} "
        f"({_pct(g.before_p90_abs)} → {_pct(g.after_p90_abs)})"
    )


def render(points: Sequence[Point], traces: Mapping[str, str]) -> list[str]:
    """Markdown tables per trace (``traces``: name -> title): goodput on every path, then what
    Sluice (and each variant, its path named) admitted, its forecast errors and its admission by
    prompt-size quartile."""
    lines: list[str] = []
    for trace, title in traces.items():
        mine = [p for p in points if p.trace == trace]
        if not mine:
            continue
        lines += [
            f"**{title}**",
            "",
            "| load | offered req/s | path | good req/s | good tokens/s | refused | admitted that met both | "
            "TTFT p50 / p90 s | bursts |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for p in mine:
            s = p.stats
            lines.append(
                f"| {p.load:g}x | {p.rate_per_s:.2f} | {p.path} | {s.good_per_s:.2f} "
                f"| {s.good_tokens_per_s:.0f} "
                f"| {s.refused} of {s.offered} | {_pct(s.admitted_attainment)} ({s.met} of {s.admitted}) "
                f"| {_s(s.ttft_p50_s)} / {_s(s.ttft_p90_s)} | {s.bursts} of {s.streams} |"
            )
        lines += [
            "",
            "| load | TTFT error, gateway: median before → after (p90 abs) | TPOT error, gateway | "
            "TTFT error, headers vs client: median / p90 abs | TPOT, headers vs client | "
            "admitted by prompt quartile (shortest → longest) |",
            "|---:|---|---|---|---|---|",
        ]
        for p in mine:
            if p.path == "direct":
                continue
            g, h = p.gateway or {}, p.header or {}
            quartiles = " / ".join(_pct(r) for r in p.stats.quartile_rates)
            load = f"{p.load:g}x" if p.path == "sluice" else f"{p.load:g}x, {p.path}"
            lines.append(
                f"| {load} | {_gw(g.get('ttft'))} | {_gw(g.get('tpot'))} | {_err(h.get('ttft'))} "
                f"| {_err(h.get('tpot'))} | {quartiles} |"
            )
        lines.append("")
    return lines
