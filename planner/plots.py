"""The plan's plots as PNG files, when matplotlib (the ``bench`` extra) is installed.

``plot_curve`` draws TTFT and TPOT p50/p99 against utilisation (``planner.curve``), with the
class's targets as dashed lines. Returns ``None`` without matplotlib: the report says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from planner.curve import CurvePoint

__all__ = ["plot_curve"]


def plot_curve(
    points: Sequence[CurvePoint], ttft_target_s: float, tpot_target_s: float, path: Path
) -> Path | None:
    """Write the latency-against-utilisation plot to ``path`` (its folder is created); ``None``
    when matplotlib is not installed or there are no points."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not points:
        return None
    loads = [100 * p.load for p in points]
    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, p50, p99, target, name in (
        (ttft, [p.ttft_p50_s for p in points], [p.ttft_p99_s for p in points], ttft_target_s, "TTFT"),
        (tpot, [p.tpot_p50_s for p in points], [p.tpot_p99_s for p in points], tpot_target_s, "TPOT"),
    ):
        ax.plot(loads, [1e3 * v if not math.isnan(v) else math.nan for v in p50], marker="o", label="p50")
        ax.plot(loads, [1e3 * v if not math.isnan(v) else math.nan for v in p99], marker="o", label="p99")
        ax.axhline(1e3 * target, linestyle="--", color="grey", label="target")
        ax.set_xlabel("load, % of one replica's saturated throughput")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("One replica, no admission: latency against load")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
