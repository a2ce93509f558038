"""Model architecture facts and the per-token quantities the roofline prior derives from them.

A ``ModelArch`` is what an operator can read off a model's ``config.json``; it yields weight bytes,
KV bytes per token and FLOPs per token (formulas in docs/predictor.md). The catalogue's parameter
counts are computed from the architecture and match the published counts (the unit tests pin them).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

__all__ = ["MODELS", "ModelArch", "llama_style", "lookup_model", "model_names"]


@dataclass(frozen=True, slots=True)
class ModelArch:
    """A decoder-only transformer's shape.

    ``num_params``: total parameters including embeddings (a count, not bytes).
    ``dtype_bytes``: bytes per weight element (2 BF16/FP16, 1 FP8, 0.5 for 4-bit weights).
    ``kv_dtype_bytes``: bytes per KV-cache element (2, or 1 with an FP8 KV cache).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: float
    dtype_bytes: float = 2.0
    kv_dtype_bytes: float = 2.0

    def __post_init__(self) -> None:
        ints = {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
        }
        bad = [f"{k}={v}" for k, v in ints.items() if v < 1]
        if self.num_params <= 0:
            bad.append(f"num_params={self.num_params}")
        if self.dtype_bytes <= 0:
            bad.append(f"dtype_bytes={self.dtype_bytes}")
        if self.kv_dtype_bytes <= 0:
            bad.append(f"kv_dtype_bytes={self.kv_dtype_bytes}")
        if bad:
            raise ValueError(f"model {self.name!r}: must be positive: {', '.join(bad)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights read by one forward pass (all devices together)."""
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes one token occupies across all layers (all devices together)."""
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def attention_width(self) -> int:
        """Query heads x head dim: the width of QK^T and AV (``d_attn``)."""
        return self.num_heads * self.head_dim

    @property
    def linear_flops_per_token(self) -> float:
        """FLOPs of the weight GEMMs per token: 2 x params."""
        return 2.0 * self.num_params

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs per (query token, attended token) pair over all layers: 4 x layers x d_attn."""
        return 4.0 * self.num_layers * self.attention_width

    def flops_per_token(self, context_tokens: float = 0.0) -> float:
        """Forward FLOPs for one token that attends to ``context_tokens`` tokens (>= 0)."""
        return self.linear_flops_per_token + self.attention_flops_per_pair * max(0.0, context_tokens)

    def with_dtype(self, dtype_bytes: float, kv_dtype_bytes: float | None = None) -> ModelArch:
        """The same architecture with another weight (and optionally KV) precision."""
        kv = self.kv_dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        return dataclasses.replace(self, dtype_bytes=dtype_bytes, kv_dtype_bytes=kv)


def llama_style(
    name: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    head_dim: int | None = None,
    qkv_bias: bool = False,
    tied_embeddings: bool = False,
    dtype_bytes: float = 2.0,
) -> ModelArch:
    """A Llama-family architecture (GQA, SwiGLU MLP, RMSNorm) with its exact parameter count.

    Per layer: q/o projections ``hidden x heads*head_dim`` each, k/v ``hidden x kv_heads*head_dim``
    each (+ biases when ``qkv_bias``, as in Qwen2), three MLP matrices ``hidden x intermediate``,
    two norms; plus input embeddings, an output head unless ``tied_embeddings``, and a final norm.
    """
    hd = head_dim if head_dim is not None else hidden // heads
    attn = 2 * hidden * heads * hd + 2 * hidden * kv_heads * hd
    bias = (heads * hd + 2 * kv_heads * hd) if qkv_bias else 0
    per_layer = attn + bias + 3 * hidden * intermediate + 2 * hidden
    embeddings = vocab * hidden * (1 if tied_embeddings else 2)
    params = layers * per_layer + embeddings + hidden
    return ModelArch(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hd,
        intermediate_size=intermediate,
        vocab_size=vocab,
        num_params=float(params),
        dtype_bytes=dtype_bytes,
    )


# Shapes from each model's config.json on the Hugging Face Hub.
_CATALOGUE: Final[tuple[ModelArch, ...]] = (
    llama_style("Llama-2-7B", layers=32, hidden=4096, heads=32, kv_heads=32, intermediate=11008, vocab=32000),
    llama_style(
        "Llama-2-13B", layers=40, hidden=5120, heads=40, kv_heads=40, intermediate=13824, vocab=32000
    ),
    llama_style("Llama-2-70B", layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=32000),
    llama_style("Llama-3-8B", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    llama_style(
        "Llama-3-70B", layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=128256
    ),
    llama_style(
        "Llama-3.2-1B",
        layers=16,
        hidden=2048,
        heads=32,
        kv_heads=8,
        head_dim=64,
        intermediate=8192,
        vocab=128256,
        tied_embeddings=True,
    ),
    llama_style(
        "Llama-3.2-3B",
        layers=28,
        hidden=3072,
        heads=24,
        kv_heads=8,
        head_dim=128,
        intermediate=8192,
        vocab=128256,
        tied_embeddings=True,
    ),
    llama_style("Mistral-7B", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=32000),
    llama_style(
        "Qwen2.5-0.5B",
        layers=24,
        hidden=896,
        heads=14,
        kv_heads=2,
        head_dim=64,
        intermediate=4864,
        vocab=151936,
        qkv_bias=True,
        tied_embeddings=True,
    ),
    llama_style(
        "Qwen2.5-7B",
        layers=28,
        hidden=3584,
        heads=28,
        kv_heads=4,
        intermediate=18944,
        vocab=152064,
        qkv_bias=True,
    ),
    llama_style(
        "Qwen2.5-14B",
        layers=48,
        hidden=5120,
        heads=40,
        kv_heads=8,
        intermediate=13824,
        vocab=152064,
        qkv_bias=True,
    ),
    llama_style(
        "Qwen2.5-72B",
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        intermediate=29568,
        vocab=152064,
        qkv_bias=True,
    ),
)

#: Canonical name -> architecture (BF16 weights and KV). Read-only.
MODELS: Final = MappingProxyType({m.name: m for m in _CATALOGUE})

# Same architecture under another name (Llama 3.1/3.3 only changed RoPE scaling and context).
_SAME_SHAPE: Final[dict[str, str]] = {
    "llama318b": "Llama-3-8B",
    "llama3170b": "Llama-3-70B",
    "llama3370b": "Llama-3-70B",
    "mistral7bv01": "Mistral-7B",
    "mistral7bv02": "Mistral-7B",
    # v0.3 grew the vocabulary to 32768: 6M more parameters (0.08%), ignored.
    "mistral7bv03": "Mistral-7B",
}

_VARIANT: Final = re.compile(r"-(instruct|chat|hf|base|it)(?=-|$)")
_FP8 = re.compile(r"[-_.]fp8(-dynamic)?$")


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_BY_KEY: Final[dict[str, str]] = {_key(n): n for n in MODELS} | _SAME_SHAPE


def lookup_model(name: str) -> ModelArch | None:
    """The architecture behind a catalogue name or a Hugging Face id, or ``None`` if unknown.

    Accepts e.g. ``"Llama-3-8B"``, ``"meta-llama/Meta-Llama-3.1-8B-Instruct"``,
    ``"Qwen/Qwen2.5-7B-Instruct"``; an ``-FP8`` suffix returns the same shape with 1-byte weights.
    """
    base = name.strip().rsplit("/", 1)[-1].lower()
    fp8 = _FP8.search(base) is not None
    base = _FP8.sub("", base)
    base = _VARIANT.sub("", base).removeprefix("meta-")
    canonical = _BY_KEY.get(_key(base))
    if canonical is None:
        return None
    arch = MODELS[canonical]
    return arch.with_dtype(1.0) if fp8 else arch


def model_names() -> tuple[str, ...]:
    """Canonical catalogue names, in table order."""
    return tuple(MODELS)
