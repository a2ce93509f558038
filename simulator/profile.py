"""Replica profiles: one GPU x model x engine configuration, loaded from ``simulator/profiles/*.yaml``
(package data, installed with the emulator; ``config/profiles`` in a checkout links to it).

A profile holds the GPU and model facts, the engine limits (vLLM's ``SchedulerConfig`` /
``CacheConfig``), the measured per-layer linear timing table (Vidur), the output-length
distribution and the API server's work in front of the engine (``api_server``, none by
default). Every model is frozen and rejects unknown keys. Units are in the field names
(``_s`` seconds, ``_bytes`` bytes, ``_Bps`` bytes per second, ``_flops`` FLOP/s, ``_ms`` ms).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from simulator.apiserver import ApiServerCosts

#: Where bare profile names are looked up: the package's own ``profiles`` folder.
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuFacts(_Frozen):
    """One accelerator (per GPU, not per replica)."""

    name: str = Field(min_length=1, description="Marketing name, e.g. 'H100-SXM5-80GB'.")
    memory_bytes: PositiveInt = Field(description="Device memory as the driver reports it, in bytes.")
    hbm_bandwidth_Bps: PositiveFloat = Field(description="Peak HBM bandwidth, bytes per second.")
    peak_bf16_flops: PositiveFloat = Field(description="Peak dense BF16 tensor-core FLOP per second.")
    allreduce_bus_bandwidth_Bps: PositiveFloat = Field(
        description="Achieved all-reduce bus bandwidth between the tensor-parallel GPUs (nccl-tests "
        "'busbw'), bytes per second. Unused at tensor_parallel = 1."
    )
    allreduce_latency_s: Annotated[float, Field(ge=0)] = Field(
        description="Fixed cost of one small all-reduce, seconds. Unused at tensor_parallel = 1."
    )


class ModelFacts(_Frozen):
    """Shape of the served model (from its Hugging Face ``config.json``)."""

    name: str = Field(min_length=1, description="Hugging Face id of the architecture the facts describe.")
    num_layers: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    vocab_size: PositiveInt
    num_params: PositiveInt = Field(description="Total parameters (weights held in GPU memory).")
    dtype_bytes: PositiveInt = Field(description="Bytes per weight and per KV element (2 for bf16).")


class EngineLimits(_Frozen):
    """vLLM engine limits (``SchedulerConfig``, ``CacheConfig``, ``ModelConfig.max_model_len``)."""

    max_num_seqs: PositiveInt = Field(description="Most requests in RUNNING at once.")
    max_num_batched_tokens: PositiveInt = Field(description="Token budget of one engine step.")
    block_size: PositiveInt = Field(description="Tokens per KV-cache block.")
    num_gpu_blocks: PositiveInt = Field(description="KV-cache blocks per GPU (vLLM's num_gpu_blocks).")
    max_model_len: PositiveInt = Field(description="Most tokens (prompt + output) of one request.")
    gpu_memory_utilization: Fraction = Field(description="Share of device memory vLLM may use.")
    non_kv_reserve_bytes: Annotated[int, Field(ge=0)] = Field(
        description="Per-GPU memory inside the utilization budget that is not weights and not KV: peak "
        "activations of the profiling run, CUDA-graph pool, non-torch allocations, in bytes."
    )
    cache_dtype: str = Field(default="auto", description="vLLM's --kv-cache-dtype ('auto' = model dtype).")
    enable_prefix_caching: bool = Field(
        default=True,
        description="vLLM's --enable-prefix-caching (on by default in vLLM V1): full KV blocks are "
        "cached by the hash of their prefix and a request's prefill skips its cached prefix.",
    )


class CostParams(_Frozen):
    """Constants of the step-time model in ``simulator/costmodel.py``."""

    per_step_overhead_s: Annotated[float, Field(ge=0)] = Field(
        description="Host-side time of every step (scheduling, input preparation, sampling), seconds."
    )
    linear_ms_per_layer: dict[PositiveInt, PositiveFloat] = Field(
        description="Measured time of one transformer layer's token-parallel operators (QKV, RoPE, O, "
        "norms, gated MLP, add; not attention) at a step of num_tokens tokens: {num_tokens: ms}."
    )
    linear_scale: PositiveFloat = Field(
        default=1.0,
        description="Multiplier applied to linear_ms_per_layer when the table was measured on a "
        "neighbouring model (1.0 when it is the served model's own table).",
    )
    hbm_efficiency: Fraction = Field(
        description="Achieved share of hbm_bandwidth_Bps for KV reads and the LM-head weight read."
    )
    attention_flops_efficiency: Fraction = Field(
        description="Achieved share of peak_bf16_flops for prefill attention (FlashAttention) and the "
        "LM-head GEMM when it is compute-bound."
    )

    @model_validator(mode="after")
    def _table_has_points(self) -> CostParams:
        if len(self.linear_ms_per_layer) < 2:
            raise ValueError("linear_ms_per_layer needs at least two points to interpolate")
        return self


class StepModelParams(_Frozen):
    """A step-time model fitted elsewhere (a running gateway's predictor), priced in place of the
    per-layer table: ``base + per_token x min(N, knee) + per_compute_token x max(0, N - knee) +
    per_decode_seq x decodes + per_kv_token x KV tokens read + per_attn_pair x prefill pairs``,
    ``N`` the step's tokens (the formula of ``predictor.StepModel``, docs/predictor.md). Seconds
    per unit; ``source`` says where the coefficients came from, for reports."""

    base_s: Annotated[float, Field(ge=0)]
    per_token_s: Annotated[float, Field(ge=0)]
    per_decode_seq_s: Annotated[float, Field(ge=0)]
    per_compute_token_s: Annotated[float, Field(ge=0)]
    per_kv_token_s: Annotated[float, Field(ge=0)]
    per_attn_pair_s: Annotated[float, Field(ge=0)] = 0.0
    knee_tokens: Annotated[float, Field(ge=0)]
    source: str = ""


class OutputLengths(_Frozen):
    """Output lengths drawn when the client lets the model stop on its own (no ignore_eos)."""

    distribution: Literal["lognormal"] = "lognormal"
    median_tokens: PositiveFloat = Field(description="Median of the lognormal, tokens.")
    sigma: Annotated[float, Field(ge=0)] = Field(description="Standard deviation of ln(tokens).")


class Profile(_Frozen):
    """One emulated replica: GPU x model x tensor parallelism x engine limits x cost constants."""

    name: str = Field(min_length=1, description="Profile name (the YAML file's stem).")
    description: str = Field(default="", description="One line for humans.")
    served_model_name: str = Field(min_length=1, description="Model id answered by /v1/models.")
    tensor_parallel: PositiveInt = Field(description="GPUs per replica (tensor-parallel degree).")
    gpu: GpuFacts
    model: ModelFacts
    engine: EngineLimits
    cost: CostParams
    output_lengths: OutputLengths
    step_model: StepModelParams | None = Field(
        default=None,
        description="A fitted step model that prices every step instead of ``cost`` (whose table "
        "and efficiencies are then unused); none by default.",
    )
    api_server: ApiServerCosts = Field(
        default_factory=ApiServerCosts,
        description="The API server's tokenisation and streaming work and whose CPU it shares "
        "(simulator/apiserver.py); all 0 by default: none modelled.",
    )

    @model_validator(mode="after")
    def _fits_in_memory(self) -> Profile:
        if self.model.num_heads % self.tensor_parallel or self.model.num_kv_heads % self.tensor_parallel:
            raise ValueError(
                f"tensor_parallel={self.tensor_parallel} must divide num_heads={self.model.num_heads} "
                f"and num_kv_heads={self.model.num_kv_heads}"
            )
        fit = kv_blocks_that_fit(self)
        if self.engine.num_gpu_blocks > fit:
            raise ValueError(
                f"engine.num_gpu_blocks={self.engine.num_gpu_blocks} exceeds the {fit} blocks that fit in "
                f"{self.gpu.memory_bytes} bytes x {self.engine.gpu_memory_utilization} "
                "minus weights and reserve"
            )
        return self

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies on ONE GPU: 2 x layers x kv_heads x head_dim x dtype / TP."""
        m = self.model
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes // self.tensor_parallel

    @property
    def weight_bytes_per_gpu(self) -> int:
        """Weight bytes held by each GPU (weights are split evenly across tensor-parallel ranks)."""
        return self.model.num_params * self.model.dtype_bytes // self.tensor_parallel

    @property
    def kv_cache_size_tokens(self) -> int:
        """Tokens the KV cache holds: num_gpu_blocks x block_size."""
        return self.engine.num_gpu_blocks * self.engine.block_size

    def cache_config_info(self) -> dict[str, str | int | float | bool]:
        """The ``CacheConfig`` facts vLLM exports as labels of ``vllm:cache_config_info``."""
        return {
            "block_size": self.engine.block_size,
            "num_gpu_blocks": self.engine.num_gpu_blocks,
            "kv_cache_size_tokens": self.kv_cache_size_tokens,
            "kv_cache_memory_bytes": self.kv_cache_size_tokens * self.kv_bytes_per_token,
            "cache_dtype": self.engine.cache_dtype,
            "gpu_memory_utilization": self.engine.gpu_memory_utilization,
            "enable_prefix_caching": self.engine.enable_prefix_caching,
        }

    def with_engine(self, **changes: int | float | str) -> Profile:
        """A validated copy with some ``engine`` fields replaced (e.g. ``max_num_seqs=4``)."""
        data = self.model_dump()
        data["engine"] = {**data["engine"], **changes}
        return Profile.model_validate(data)

    def with_api_server(self, costs: ApiServerCosts) -> Profile:
        """A copy whose API server does ``costs``' work (``ApiServerCosts()``: none)."""
        return self.model_copy(update={"api_server": costs})


def kv_blocks_that_fit(profile: Profile) -> int:
    """KV blocks per GPU that fit: (memory x utilization - weights - reserve) / block bytes, floored.

    The same arithmetic vLLM does after its profiling run (``determine_available_memory``), with the
    activation peak replaced by the profile's ``non_kv_reserve_bytes``. Never negative.
    """
    budget = profile.gpu.memory_bytes * profile.engine.gpu_memory_utilization
    free = budget - profile.weight_bytes_per_gpu - profile.engine.non_kv_reserve_bytes
    block_bytes = profile.engine.block_size * profile.kv_bytes_per_token
    return max(0, math.floor(free / block_bytes))


def list_profiles() -> list[str]:
    """Names of the profiles shipped in ``PROFILES_DIR``, sorted."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_profile(name_or_path: str) -> Profile:
    """Load and validate a profile by bare name (``PROFILES_DIR/<name>.yaml``) or by a .yaml path.

    Raises ``ValueError`` for an unknown name (listing the available ones), a missing file, or a file
    that fails validation (pydantic's message, every error at once).
    """
    path = _resolve(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"profile {path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"profile {path}: expected a mapping at the top level")
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"profile {path}: {exc}") from exc


def _resolve(name_or_path: str) -> Path:
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"profile file not found: {path}")
        return path
    path = PROFILES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        available = ", ".join(list_profiles()) or "(none)"
        raise ValueError(f"unknown profile {name_or_path!r}; available: {available}")
    return path
