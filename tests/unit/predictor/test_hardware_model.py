"""GPU and model facts: the tables, the lookups, and the roofline terms with hand-checked numbers."""

from __future__ import annotations

import pytest

from predictor.hardware import GPUS, UNKNOWN_GPU, GpuSpec, lookup_gpu
from predictor.model import MODELS, ModelArch, llama_style, lookup_model
from predictor.step_model import IDEAL, Efficiency, roofline_terms

REQUIRED_GPUS = ("H100-SXM", "H100-PCIe", "H200", "A100-80GB-SXM", "A100-40GB", "L40S", "L4", "A10G", "cpu")


@pytest.mark.parametrize("name", REQUIRED_GPUS, ids=REQUIRED_GPUS)
def test_required_gpus_are_in_the_table(name: str) -> None:
    spec = GPUS[name]
    assert spec.known == (name != "cpu")


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("H100-SXM", "H100-SXM"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("h100", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB-SXM"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB-PCIe"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10G", "A10G"),
        ("cpu", "cpu"),
        ("unknown", "cpu"),
    ],
    ids=lambda v: str(v),
)
def test_lookup_gpu_accepts_common_spellings(spelling: str, canonical: str) -> None:
    spec = lookup_gpu(spelling)
    assert spec is not None
    assert spec.name == canonical


@pytest.mark.parametrize(
    "spelling", ["A100", "H1000", "TPU-v5e", ""], ids=["ambiguous-a100", "typo", "tpu", "empty"]
)
def test_lookup_gpu_returns_none_for_unrecognised_names(spelling: str) -> None:
    assert lookup_gpu(spelling) is None


def test_fp8_uses_fp8_tensor_cores_only_where_they_exist() -> None:
    assert GPUS["H100-SXM"].peak_flops(1.0) == pytest.approx(2 * GPUS["H100-SXM"].peak_flops(2.0), rel=1e-3)
    assert GPUS["A100-80GB-SXM"].peak_flops(1.0) == GPUS["A100-80GB-SXM"].peak_bf16_flops


def test_unknown_gpu_has_no_ceilings() -> None:
    assert not UNKNOWN_GPU.known
    with pytest.raises(ValueError, match="unknown hardware"):
        roofline_terms(MODELS["Llama-3-8B"], UNKNOWN_GPU)


def test_gpu_spec_rejects_negative_numbers() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        GpuSpec("bad", -1.0, 1.0, 1.0)


# Published parameter counts (Hugging Face model cards / safetensors metadata).
@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("Llama-2-7B", 6_738_415_616),
        ("Llama-2-13B", 13_015_864_320),
        ("Llama-2-70B", 68_976_648_192),
        ("Llama-3-8B", 8_030_261_248),
        ("Llama-3-70B", 70_553_706_496),
        ("Llama-3.2-1B", 1_235_814_400),
        ("Mistral-7B", 7_241_732_096),
        ("Qwen2.5-0.5B", 494_032_768),
        ("Qwen2.5-7B", 7_615_616_512),
        ("Qwen2.5-72B", 72_706_203_648),
    ],
    ids=lambda v: str(v),
)
def test_catalogue_parameter_counts_match_published(name: str, params: int) -> None:
    assert MODELS[name].num_params == params


# KV bytes per token = 2 x layers x kv_heads x head_dim x 2 bytes (math.md §1.2 table).
@pytest.mark.parametrize(
    ("name", "kv_bytes"),
    [
        ("Llama-2-7B", 2 * 32 * 32 * 128 * 2),  # 512 KiB, MHA
        ("Llama-3-8B", 2 * 32 * 8 * 128 * 2),  # 128 KiB = 131072 B
        ("Qwen2.5-7B", 2 * 28 * 4 * 128 * 2),  # 56 KiB
        ("Llama-3-70B", 2 * 80 * 8 * 128 * 2),  # 320 KiB
        ("Llama-2-70B", 2 * 80 * 8 * 128 * 2),
    ],
    ids=lambda v: str(v),
)
def test_kv_bytes_per_token(name: str, kv_bytes: int) -> None:
    assert MODELS[name].kv_bytes_per_token == kv_bytes


def test_llama3_8b_derived_quantities_by_hand() -> None:
    m = MODELS["Llama-3-8B"]
    assert m.weight_bytes == pytest.approx(16.06e9, rel=1e-3)
    assert m.kv_bytes_per_token == 131072
    assert m.flops_per_token() == pytest.approx(2 * 8.030e9, rel=1e-3)
    # At 1024 tokens of context, QK^T and AV add 4 x 32 layers x 4096 x 1024 FLOPs.
    assert m.flops_per_token(1024) - m.flops_per_token() == pytest.approx(4 * 32 * 4096 * 1024)


# Ideal roofline (datasheet peaks, no overheads), Llama-3-8B BF16 on one H100 SXM (math.md §1.3).
@pytest.mark.parametrize(
    ("term", "expected"),
    [
        ("weight_read_s", 16.0605e9 / 3.35e12),  # ~4.79 ms
        ("compute_s_per_token", 2 * 8.0303e9 / 989.4e12),  # ~16.2 us
        ("kv_s_per_token", 131072 / 3.35e12),  # ~39 ns
        ("knee_tokens", 989.4e12 / 3.35e12),  # ~295 tokens: F/BW for 2-byte weights
        ("attn_s_per_pair", 4 * 32 * 4096 / 989.4e12),
        ("overhead_s", 0.0),
    ],
    ids=lambda v: str(v),
)
def test_roofline_terms_llama3_8b_h100(term: str, expected: float) -> None:
    terms = roofline_terms(MODELS["Llama-3-8B"], GPUS["H100-SXM"], efficiency=IDEAL)
    assert getattr(terms, term) == pytest.approx(expected, rel=1e-3)


def test_weight_read_is_about_4_8_ms() -> None:
    terms = roofline_terms(MODELS["Llama-3-8B"], GPUS["H100-SXM"], efficiency=IDEAL)
    assert 4.7e-3 < terms.weight_read_s < 4.9e-3


def test_tensor_parallel_divides_time_and_adds_allreduces() -> None:
    m, g = MODELS["Llama-3-70B"], GPUS["H100-SXM"]
    eff = Efficiency(step_overhead_s=0.0, allreduce_latency_s=10e-6)
    one = roofline_terms(m, g, tensor_parallel=1, efficiency=eff)
    four = roofline_terms(m, g, tensor_parallel=4, efficiency=eff)
    assert four.weight_read_s == pytest.approx(one.weight_read_s / 4)
    assert four.compute_s_per_token == pytest.approx(one.compute_s_per_token / 4)
    assert four.knee_tokens == pytest.approx(one.knee_tokens)
    assert four.overhead_s == pytest.approx(2 * 80 * 10e-6)
    assert one.overhead_s == 0.0


@pytest.mark.parametrize(
    ("hf_id", "canonical", "dtype_bytes"),
    [
        ("meta-llama/Meta-Llama-3-8B-Instruct", "Llama-3-8B", 2.0),
        ("meta-llama/Llama-3.1-8B-Instruct", "Llama-3-8B", 2.0),
        ("meta-llama/Llama-3.3-70B-Instruct", "Llama-3-70B", 2.0),
        ("meta-llama/Llama-2-7b-chat-hf", "Llama-2-7B", 2.0),
        ("mistralai/Mistral-7B-Instruct-v0.2", "Mistral-7B", 2.0),
        ("Qwen/Qwen2.5-72B-Instruct", "Qwen2.5-72B", 2.0),
        ("neuralmagic/Meta-Llama-3-8B-Instruct-FP8", "Llama-3-8B", 1.0),
    ],
    ids=lambda v: str(v),
)
def test_lookup_model_accepts_hugging_face_ids(hf_id: str, canonical: str, dtype_bytes: float) -> None:
    arch = lookup_model(hf_id)
    assert arch is not None
    assert (arch.name, arch.dtype_bytes) == (canonical, dtype_bytes)


def test_lookup_model_unknown_is_none() -> None:
    assert lookup_model("tiny-llama") is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0}, "num_layers=0"),
        ({"num_params": 0.0}, "num_params"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"dtype_bytes": 0.0}, "dtype_bytes"),
    ],
    ids=["zero-layers", "zero-params", "gqa-mismatch", "zero-dtype"],
)
def test_model_arch_rejects_bad_shapes(kwargs: dict[str, float], message: str) -> None:
    base: dict[str, object] = {
        "name": "x",
        "num_layers": 2,
        "hidden_size": 256,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "num_params": 1e6,
    }
    with pytest.raises(ValueError, match=message):
        ModelArch(**(base | kwargs))  # type: ignore[arg-type]


def test_operator_defined_model_works_like_a_catalogue_one() -> None:
    tiny = llama_style("tiny-llama", layers=2, hidden=256, heads=4, kv_heads=4, intermediate=512, vocab=1000)
    assert tiny.kv_bytes_per_token == 2 * 2 * 4 * 64 * 2
    assert tiny.num_params > 0
