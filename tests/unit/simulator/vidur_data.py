"""Independent reading of the copied Vidur CSVs, so tests do not trust simulator.build_profile_tables."""

from __future__ import annotations

import csv
import statistics
from functools import cache
from pathlib import Path

VIDUR_DIR = Path(__file__).resolve().parents[2] / "data" / "vidur"

#: The per-layer operators of one transformer layer (Vidur's execution-time model; emb excluded).
OPS = (
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

#: Which measured table each shipped profile's cost.linear_ms_per_layer comes from.
PROFILE_SOURCES = {
    "llama3-8b-h100": ("h100_Llama-2-7b-hf_mlp.csv", 1),
    "llama3-8b-a100": ("a100_Meta-Llama-3-8B_mlp.csv", 1),
    "llama2-70b-h100-tp4": ("h100_Llama-2-70b-hf_mlp.csv", 4),
}


@cache
def layer_ms(csv_name: str, tp: int) -> dict[int, float]:
    """{num_tokens: median over repeated rows of the sum of OPS medians}, in ms, unrounded."""
    rows: dict[int, list[float]] = {}
    with (VIDUR_DIR / csv_name).open(newline="") as f:
        for row in csv.DictReader(f):
            if int(row["num_tensor_parallel_workers"]) == tp:
                total = sum(float(row[f"time_stats.{op}.median"]) for op in OPS)
                rows.setdefault(int(row["num_tokens"]), []).append(total)
    return {n: statistics.median(v) for n, v in sorted(rows.items())}


def tp_degrees(csv_name: str) -> set[int]:
    """Tensor-parallel degrees present in a CSV."""
    with (VIDUR_DIR / csv_name).open(newline="") as f:
        return {int(row["num_tensor_parallel_workers"]) for row in csv.DictReader(f)}
