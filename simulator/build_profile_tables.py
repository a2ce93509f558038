"""Derive the per-layer linear timing tables of ``simulator/profiles/*.yaml`` from Vidur's CSVs.

``python -m simulator.build_profile_tables CSV --tp N`` prints ``linear_ms_per_layer`` as YAML;
``--ratio-to OTHER_CSV`` prints instead the median ratio of the two tables at their shared token
counts (what ``linear_scale`` records). One layer's time is the sum of the medians of the operators
in ``LAYER_OPS`` (``emb`` left out: it runs once per step). Standard library only; usage and
rationale in docs/emulator.md.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict
from pathlib import Path

#: Per-layer token-parallel operators of Vidur's ``mlp.csv`` that make one layer's linear time.
LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)

#: Decimal places kept in the YAML (ms): 10 ns, far below the measurement noise.
DECIMALS = 5


def per_layer_linear_ms(csv_path: Path, tensor_parallel: int) -> dict[int, float]:
    """{num_tokens: ms} for one layer at the given tensor-parallel degree, rounded to DECIMALS."""
    sums: dict[int, list[float]] = defaultdict(list)
    with csv_path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if int(row["num_tensor_parallel_workers"]) != tensor_parallel:
                continue
            total = sum(float(row[f"time_stats.{op}.median"]) for op in LAYER_OPS)
            sums[int(row["num_tokens"])].append(total)
    if not sums:
        raise ValueError(f"{csv_path}: no rows with num_tensor_parallel_workers={tensor_parallel}")
    return {n: round(statistics.median(v), DECIMALS) for n, v in sorted(sums.items())}


def median_ratio(numerator: dict[int, float], denominator: dict[int, float]) -> float:
    """Median over shared num_tokens of numerator / denominator."""
    shared = sorted(set(numerator) & set(denominator))
    if not shared:
        raise ValueError("the two tables share no num_tokens")
    return statistics.median(numerator[n] / denominator[n] for n in shared)


def to_yaml(table: dict[int, float], indent: int = 4) -> str:
    """The table as YAML mapping lines, one point per line."""
    pad = " " * indent
    return "\n".join(f"{pad}{n}: {ms}" for n, ms in table.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("csv", type=Path, help="Vidur mlp.csv")
    parser.add_argument("--tp", type=int, default=1, help="num_tensor_parallel_workers to select")
    parser.add_argument("--ratio-to", type=Path, help="print median(csv / this csv) instead")
    args = parser.parse_args(argv)
    table = per_layer_linear_ms(args.csv, args.tp)
    if args.ratio_to is None:
        print(to_yaml(table))
    else:
        print(round(median_ratio(table, per_layer_linear_ms(args.ratio_to, args.tp)), 4))


if __name__ == "__main__":
    main()
