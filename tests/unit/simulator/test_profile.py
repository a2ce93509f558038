"""Profiles: loading, validation, memory arithmetic, and the tables' agreement with Vidur's data."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from simulator.build_profile_tables import main as build_main
from simulator.build_profile_tables import median_ratio, per_layer_linear_ms
from simulator.profile import PROFILES_DIR, Profile, kv_blocks_that_fit, list_profiles, load_profile
from tests.unit.simulator.vidur_data import PROFILE_SOURCES, VIDUR_DIR, layer_ms, tp_degrees

SHIPPED = sorted(PROFILE_SOURCES)


def test_list_profiles_has_the_shipped_ones() -> None:
    assert set(SHIPPED) <= set(list_profiles())


@pytest.mark.parametrize("name", SHIPPED)
def test_profile_name_matches_file_stem(name: str) -> None:
    assert load_profile(name).name == name


@pytest.mark.parametrize("name", SHIPPED)
def test_load_by_path_equals_load_by_name(name: str) -> None:
    assert load_profile(str(PROFILES_DIR / f"{name}.yaml")) == load_profile(name)


def test_unknown_name_lists_available() -> None:
    with pytest.raises(ValueError, match=r"unknown profile 'nope'; available: .*llama3-8b-h100"):
        load_profile("nope")


def test_missing_file_is_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="profile file not found"):
        load_profile(str(tmp_path / "absent.yaml"))


def _write_variant(tmp_path: Path, mutate: dict[str, dict[str, object]]) -> str:
    data = yaml.safe_load((PROFILES_DIR / "llama3-8b-h100.yaml").read_text())
    for section, changes in mutate.items():
        data[section].update(changes)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        pytest.param({"engine": {"max_num_sqs": 4}}, "max_num_sqs", id="unknown-key"),
        pytest.param({"engine": {"block_size": 0}}, "block_size", id="zero-block-size"),
        pytest.param(
            {"engine": {"num_gpu_blocks": 10**7}}, "exceeds the 28019 blocks", id="blocks-beyond-memory"
        ),
        pytest.param(
            {"engine": {"enable_prefix_caching": "sometimes"}}, "enable_prefix_caching", id="prefix-caching"
        ),
        pytest.param(
            {"cost": {"linear_ms_per_layer": {1: 0.1}}}, "at least two points", id="one-point-table"
        ),
        pytest.param({"cost": {"hbm_efficiency": 1.5}}, "hbm_efficiency", id="efficiency-above-1"),
        pytest.param(
            {"output_lengths": {"distribution": "normal"}}, "distribution", id="unknown-distribution"
        ),
    ],
)
def test_invalid_profiles_are_rejected(
    tmp_path: Path, mutate: dict[str, dict[str, object]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_profile(_write_variant(tmp_path, mutate))


def test_tensor_parallel_must_divide_heads(tmp_path: Path) -> None:
    data = yaml.safe_load((PROFILES_DIR / "llama3-8b-h100.yaml").read_text())
    data["tensor_parallel"] = 3
    path = tmp_path / "tp3.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="tensor_parallel=3 must divide"):
        load_profile(str(path))


def test_profile_is_frozen() -> None:
    profile = load_profile("llama3-8b-h100")
    with pytest.raises(ValueError, match="frozen"):
        profile.engine.max_num_seqs = 1  # type: ignore[misc]


@pytest.mark.parametrize("name", SHIPPED)
def test_num_gpu_blocks_is_what_memory_allows(name: str) -> None:
    profile = load_profile(name)
    assert profile.engine.num_gpu_blocks == kv_blocks_that_fit(profile)


@pytest.mark.parametrize(
    ("name", "kv_bytes_per_token"),
    [
        pytest.param("llama3-8b-h100", 2 * 32 * 8 * 128 * 2, id="8b-gqa-128KiB"),
        pytest.param("llama3-8b-a100", 2 * 32 * 8 * 128 * 2, id="8b-a100-128KiB"),
        pytest.param("llama2-70b-h100-tp4", 2 * 80 * 8 * 128 * 2 // 4, id="70b-tp4-80KiB-per-gpu"),
    ],
)
def test_kv_bytes_per_token(name: str, kv_bytes_per_token: int) -> None:
    assert load_profile(name).kv_bytes_per_token == kv_bytes_per_token


def test_cache_config_info() -> None:
    profile = load_profile("llama3-8b-h100")
    info = profile.cache_config_info()
    assert info == {
        "block_size": 16,
        "num_gpu_blocks": 28019,
        "kv_cache_size_tokens": 28019 * 16,
        "kv_cache_memory_bytes": 28019 * 16 * 131072,
        "cache_dtype": "auto",
        "gpu_memory_utilization": 0.9,
        "enable_prefix_caching": True,
    }


def test_with_engine_replaces_and_validates() -> None:
    profile = load_profile("llama3-8b-h100")
    small = profile.with_engine(max_num_seqs=4, num_gpu_blocks=10)
    assert (small.engine.max_num_seqs, small.engine.num_gpu_blocks) == (4, 10)
    assert small.cost == profile.cost
    with pytest.raises(ValueError, match="max_num_seqs"):
        profile.with_engine(max_num_seqs=0)


# ----------------------------------------------------------------- agreement with the measured data


@pytest.mark.parametrize("name", SHIPPED)
def test_linear_table_equals_csv_medians(name: str) -> None:
    """The YAML cannot drift from the data: every point is the CSV's sum of medians (5 decimals)."""
    csv_name, tp = PROFILE_SOURCES[name]
    expected = layer_ms(csv_name, tp)
    table = load_profile(name).cost.linear_ms_per_layer
    assert sorted(table) == sorted(expected)
    worst = max(abs(table[n] - expected[n]) for n in expected)
    assert worst <= 5e-6


def test_70b_profile_uses_a_tp_degree_the_csv_has() -> None:
    assert load_profile("llama2-70b-h100-tp4").tensor_parallel in tp_degrees("h100_Llama-2-70b-hf_mlp.csv")


def test_8b_h100_linear_scale_is_the_measured_a100_ratio() -> None:
    a100_8b = layer_ms("a100_Meta-Llama-3-8B_mlp.csv", 1)
    a100_7b = layer_ms("a100_Llama-2-7b-hf_mlp.csv", 1)
    shared = sorted(set(a100_8b) & set(a100_7b))
    ratios = sorted(a100_8b[n] / a100_7b[n] for n in shared)
    median = (ratios[(len(ratios) - 1) // 2] + ratios[len(ratios) // 2]) / 2
    assert load_profile("llama3-8b-h100").cost.linear_scale == pytest.approx(median, abs=1e-3)


def test_build_script_agrees_with_independent_reading() -> None:
    table = per_layer_linear_ms(VIDUR_DIR / "h100_Llama-2-7b-hf_mlp.csv", 1)
    assert table == pytest.approx(layer_ms("h100_Llama-2-7b-hf_mlp.csv", 1), abs=5e-6)
    assert median_ratio({1: 2.0, 2: 3.0}, {1: 1.0, 2: 1.0, 4: 1.0}) == 2.5


def test_build_script_rejects_missing_tp() -> None:
    with pytest.raises(ValueError, match="no rows with num_tensor_parallel_workers=3"):
        per_layer_linear_ms(VIDUR_DIR / "h100_Llama-2-7b-hf_mlp.csv", 3)


def test_build_script_prints_the_profile_table(capsys: pytest.CaptureFixture[str]) -> None:
    build_main([str(VIDUR_DIR / "h100_Llama-2-70b-hf_mlp.csv"), "--tp", "4"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == load_profile("llama2-70b-h100-tp4").cost.linear_ms_per_layer


def test_profile_model_round_trips() -> None:
    profile = load_profile("llama3-8b-a100")
    assert Profile.model_validate(profile.model_dump()) == profile
