"""load_settings / parse_settings: every bad file's exact problems, good files, the shipped YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from gateway.config.load import ConfigError, default_settings, load_settings, parse_settings
from gateway.config.settings import Settings
from gateway.replicas.config import EmulatorSettings, HealthSettings, ReplicaSettings

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
BAD = HERE / "bad"
GOOD = HERE / "good"
EXAMPLE = REPO / "config" / "sluice.example.yaml"
DEMO = REPO / "config" / "demo.yaml"

URL_PATTERN = r"'^https?://[^/\s]+(/[^\s]*)?$'"
NAME_PATTERN = r"'^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'"
KNOWN_GPUS = (
    "H100-SXM, H100-PCIe, H100-NVL, H200, A100-80GB-SXM, A100-80GB-PCIe, A100-40GB, L40S, L4, A10, A10G, "
    "MI300X"
)
KNOWN_MODELS = (
    "Llama-2-7B, Llama-2-13B, Llama-2-70B, Llama-3-8B, Llama-3-70B, Llama-3.2-1B, Llama-3.2-3B, "
    "Mistral-7B, Qwen2.5-0.5B, Qwen2.5-7B, Qwen2.5-14B, Qwen2.5-72B"
)

#: File name under bad/ -> the exact problems, in order.
BAD_CASES: dict[str, list[str]] = {
    "unknown_top_level_key.yaml": ["routing: unknown key (got {'policy': 'round_robin'})"],
    "unknown_nested_key.yaml": ["server.prot: unknown key; did you mean 'port'? (got 8080)"],
    "unknown_key_in_list_item.yaml": ["replicas.0.weight: unknown key (got 2)"],
    "wrong_type.yaml": ["server.port: Input should be a valid integer (got '8080')"],
    "bool_as_number.yaml": ["health.interval_s: Input should be a valid number (got True)"],
    "negative_timeout.yaml": ["server.upstream_connect_timeout_s: Input should be greater than 0 (got -5)"],
    "server_header_with_version.yaml": [
        "server.server_header: String should match pattern '^[!-~]+( [!-~]+)*$' "
        "(got 'sluice/1.0\\r\\nX-Injected: 1')"
    ],
    "tokenizer_missing.yaml": [
        "replicas.0.tokenizer: is neither a tokenizer.json file nor a folder that holds one "
        "(got '/nonexistent/sluice-test/tokenizer.json')"
    ],
    "bad_url.yaml": [f"replicas.0.url: String should match pattern {URL_PATTERN} (got 'localhost:8000')"],
    "unsupported_backend.yaml": [
        "replicas.0.backend: Input should be 'vllm', 'tgi', 'sglang' or 'auto' (got 'trtllm')"
    ],
    "missing_required_key.yaml": ["emulators.0.port: required key is missing"],
    "duplicate_replica_names.yaml": [
        "replicas.1.name: duplicate name, first used at replicas.0.name (got 'r0')",
        "emulators.0.name: duplicate name, first used at replicas.0.name (got 'r0')",
    ],
    "emulator_port_clash.yaml": [
        "emulators.0.port: port already used by server.port (got 8101)",
        "emulators.2.port: port already used by emulators.1.port (got 8102)",
    ],
    "no_replicas.yaml": ["replicas: at least one entry in `replicas` or `emulators` is required (got [])"],
    "health_timeout_exceeds_interval.yaml": ["health.timeout_s: must not exceed interval_s (2.0) (got 3.0)"],
    "section_not_mapping.yaml": ["logging: should be a mapping of keys to values (got None)"],
    "replicas_not_list.yaml": [
        "replicas: Input should be a valid list (got {'name': 'r0', 'url': 'http://127.0.0.1:8000'})"
    ],
    "bad_yaml_syntax.yaml": [
        "line 3, column 2: invalid YAML: expected <block end>, but found '<block mapping start>'; "
        "while parsing a block mapping started at line 1, column 1 (got ' host: 0.0.0.0')"
    ],
    "unclosed_bracket.yaml": [
        "line 2, column 1: invalid YAML: expected ',' or ']', but got '<stream end>'; "
        "while parsing a flow sequence started at line 1, column 11 (got end of file)"
    ],
    "duplicate_key.yaml": [
        "line 3, column 3: invalid YAML: duplicate key 'port', first defined at line 2 (got '  port: 9090')"
    ],
    "empty.yaml": ["file is empty: expected a mapping of sections such as `replicas:`"],
    "comments_only.yaml": ["file is empty: expected a mapping of sections such as `replicas:`"],
    "non_mapping_top_level.yaml": [
        "(top level): expected a mapping of sections such as `replicas:` "
        "(got [{'name': 'r0', 'url': 'http://127.0.0.1:8000'}])"
    ],
    "several_errors.yaml": [
        "server.max_body_bytes: Input should be greater than 0 (got 0)",
        "server.prot: unknown key; did you mean 'port'? (got 8080)",
        f"replicas.0.url: String should match pattern {URL_PATTERN} (got 'localhost:8000')",
        f"replicas.1.name: String should match pattern {NAME_PATTERN} (got 'bad name!')",
        "emulators.0.port: Input should be less than or equal to 65535 (got 70000)",
        "emulators.0.jitter: Input should be less than or equal to 0.5 (got 0.9)",
        "health.timeout_s: must not exceed interval_s (1.0) (got 2.0)",
        "logging.level: Input should be 'DEBUG', 'INFO', 'WARNING' or 'ERROR' (got 'verbose')",
        "tenancy: unknown key; did you mean 'tenants'? (got {})",
    ],
    "hardware_unknown_gpu.yaml": [
        f"replicas.0.hardware.gpu: unknown GPU; known: {KNOWN_GPUS} (or 'unknown') (got 'H1000')"
    ],
    "hardware_unknown_model.yaml": [
        f"replicas.0.hardware.model: neither a catalogue model ({KNOWN_MODELS}) "
        "nor a Hugging Face id (owner/name) (got 'llama-9000')"
    ],
    "hardware_budget_below_seqs.yaml": [
        "replicas.0.hardware.max_num_batched_tokens: must be at least max_num_seqs (512) (got 256)"
    ],
    "hardware_bad_values.yaml": [
        "emulators.0.hardware.tensor_parallel: Input should be greater than or equal to 1 (got 0)",
        "emulators.0.hardware.max_num_seqs: Input should be a valid integer (got '256')",
        "emulators.0.hardware.gpus: unknown key; did you mean 'gpu'? (got 'H100-SXM')",
    ],
    "scrape_bad_timing.yaml": [
        "scrape.timeout_s: must not exceed interval_s (2.0) (got 3.0)",
        "scrape.window_s: must be at least twice interval_s (4.0) (got 3.0)",
    ],
    "scrape_negative_interval.yaml": ["scrape.interval_s: Input should be greater than 0 (got 0)"],
    "admission_unknown_policy.yaml": [
        "admission.policy: Input should be 'slo', 'admit_all', 'concurrency_cap', 'saturation' or 'none' "
        "(got 'round_robin')"
    ],
    "admission_policy_knobs.yaml": [
        "admission.concurrency_cap.max_in_flight: Input should be greater than or equal to 1 (got 0)",
        "admission.concurrency_cap.queue_ttl_s: Input should be greater than 0 (got -1)",
        "admission.concurrency_cap.ttl_s: unknown key; did you mean 'queue_ttl_s'? (got 2)",
        "admission.saturation.queue_threshold: Input should be greater than or equal to 0 (got -1)",
        "admission.saturation.kv_threshold: Input should be less than or equal to 1 (got 1.5)",
    ],
    "workers_port_zero.yaml": [
        "server.port: 0 picks a different free port in each of the 2 workers: give a fixed port (got 0)",
        "admin.port: 0 picks a different free port in each of the 2 workers: give a fixed port (got 0)",
    ],
    # Whole-file rules are still checked when an unrelated section has a field error.
    "several_errors_with_fleet_rules.yaml": [
        "health.unhealthy_after: Input should be greater than or equal to 1 (got 0)",
        "emulators.0.name: duplicate name, first used at replicas.0.name (got 'r0')",
    ],
}


def test_every_bad_file_has_an_expectation() -> None:
    assert sorted(p.name for p in BAD.glob("*.yaml")) == sorted(BAD_CASES)


@pytest.mark.parametrize(
    ("name", "expected"), BAD_CASES.items(), ids=[n.removesuffix(".yaml") for n in BAD_CASES]
)
def test_bad_file_reports_exact_problems(name: str, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(BAD / name)
    assert caught.value.problems == expected
    assert caught.value.path == str(BAD / name)


def test_config_error_str_lists_every_problem() -> None:
    error = ConfigError("x.yaml", ["a.b: bad (got 1)", "c: unknown key (got 2)"])
    assert str(error) == "x.yaml: 2 problems in configuration\n  a.b: bad (got 1)\n  c: unknown key (got 2)"
    assert (
        str(ConfigError("y.yaml", ["file not found"]))
        == "y.yaml: 1 problem in configuration\n  file not found"
    )


@pytest.mark.parametrize(
    ("make_path", "expected"),
    [
        (lambda tmp: tmp / "absent.yaml", ["file not found"]),
        (lambda tmp: tmp, ["is a directory, not a file"]),
        (
            lambda tmp: _write_bytes(tmp / "latin1.yaml", b"server:\n  host: caf\xe9\n"),
            ["line 2, column 12: not valid UTF-8 text (got b'\\xe9')"],
        ),
    ],
    ids=["missing_file", "directory", "not_utf8"],
)
def test_unreadable_file(tmp_path: Path, make_path: Any, expected: list[str]) -> None:
    path = make_path(tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert caught.value.problems == expected


def _write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (None, ["file is empty: expected a mapping of sections such as `replicas:`"]),
        ("text", ["(top level): expected a mapping of sections such as `replicas:` (got 'text')"]),
        (
            {
                "replicas": [{"name": "r0", "url": "http://h:1"}],
                "server": {"host": "x" * 100},
                "junk": "y" * 100,
            },
            [f"junk: unknown key (got '{'y' * 76}...)"],
        ),
    ],
    ids=["none", "string", "long_value_is_cut"],
)
def test_parse_settings_rejects(data: object, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings(data, "inline")
    assert caught.value.problems == expected
    assert caught.value.path == "inline"


#: File name under good/ -> (all replica names in order, one attribute path and its value).
GOOD_CASES: dict[str, tuple[list[str], str, object]] = {
    "one_replica.yaml": (["r0"], "server.port", 8080),
    "one_emulator.yaml": (["emu-0"], "emulators.0.seed", None),
    "mixed_fleet.yaml": (["a", "b", "sim"], "health.timeout_s", 0.5),
    "integer_seconds.yaml": (["r0"], "server.upstream_read_timeout_s", 30.0),
    "hardware_facts.yaml": (["known", "outside-catalogue", "nothing-known"], "scrape.window_s", 5.0),
    "admission_concurrency_cap.yaml": (["r0"], "admission.concurrency_cap.queue_ttl_s", 1.5),
    "admission_saturation.yaml": (["r0"], "admission.saturation.kv_threshold", 0.9),
}


@pytest.mark.parametrize(
    ("replica", "expected"),
    [
        pytest.param(
            0, ("H100-SXM", "meta-llama/Meta-Llama-3-8B-Instruct", 2, 256, 8192), id="nvidia-smi-name"
        ),
        pytest.param(
            1, (None, "some-org/custom-model-v2", 1, None, None), id="unknown-gpu-outside-catalogue"
        ),
        pytest.param(2, (None, None, 1, None, None), id="nothing-stated"),
    ],
)
def test_hardware_facts(replica: int, expected: tuple[object, ...]) -> None:
    hardware = load_settings(GOOD / "hardware_facts.yaml").replicas[replica].hardware
    got = (
        hardware.canonical_gpu(),
        hardware.model,
        hardware.tensor_parallel,
        hardware.max_num_seqs,
        hardware.max_num_batched_tokens,
    )
    assert got == expected


def test_emulator_hardware_reaches_its_replica() -> None:
    settings = default_settings()
    assert [r.hardware for r in settings.all_replicas()] == [e.hardware for e in settings.emulators]
    assert settings.emulators[0].hardware.canonical_gpu() == "H100-SXM"


@pytest.mark.parametrize(
    ("name", "case"), GOOD_CASES.items(), ids=[n.removesuffix(".yaml") for n in GOOD_CASES]
)
def test_good_file_loads(name: str, case: tuple[list[str], str, object]) -> None:
    names, attribute, value = case
    settings = load_settings(GOOD / name)
    assert [r.name for r in settings.all_replicas()] == names
    assert _attribute(settings, attribute) == value


def test_every_good_file_has_an_expectation() -> None:
    assert sorted(p.name for p in GOOD.glob("*.yaml")) == sorted(GOOD_CASES)


def _attribute(settings: Settings, dotted: str) -> object:
    value: Any = settings
    for part in dotted.split("."):
        value = value[int(part)] if part.isdigit() else getattr(value, part)
    return value


def test_demo_yaml_is_the_embedded_default() -> None:
    assert load_settings(DEMO) == default_settings()


def test_embedded_default() -> None:
    settings = default_settings()
    assert (settings.server.host, settings.server.port) == ("127.0.0.1", 8080)
    assert [(e.name, e.profile, e.port, e.jitter) for e in settings.emulators] == [
        ("emu-0", "llama3-8b-h100", 8101, 0.02),
        ("emu-1", "llama3-8b-h100", 8102, 0.02),
    ]
    assert all(e.seed is not None for e in settings.emulators)
    assert [r.url for r in settings.all_replicas()] == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]


def test_settings_are_frozen() -> None:
    settings = default_settings()
    with pytest.raises(ValidationError):
        settings.server.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "build",
    [
        lambda: ReplicaSettings(name="r", url="http://h:1", extra=1),  # type: ignore[call-arg]
        lambda: EmulatorSettings(name="e", port="8101"),  # type: ignore[arg-type]
        lambda: HealthSettings(interval_s=1.0, timeout_s=1.5),
    ],
    ids=["extra_key", "strict_types", "cross_field"],
)
def test_models_validate_when_built_in_code(build: Any) -> None:
    with pytest.raises(ValidationError):
        build()


# -- the example file documents every key ---------------------------------------------------------


def test_example_validates() -> None:
    settings = load_settings(EXAMPLE)
    assert settings.replicas
    assert settings.emulators


def _fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    return dict(model.model_fields)


def _item_model(field: FieldInfo) -> type[BaseModel] | None:
    """The model a field holds, directly or as list items; None for scalars."""
    annotation = field.annotation
    args = getattr(annotation, "__args__", ())
    candidate = args[0] if getattr(annotation, "__origin__", None) is list and args else annotation
    return candidate if isinstance(candidate, type) and issubclass(candidate, BaseModel) else None


def _comment_above(lines: list[str], line: int) -> str:
    """The contiguous comment block right above 0-based ``line``, without the '#' marks."""
    block: list[str] = []
    index = line - 1
    while index >= 0 and lines[index].strip().startswith("#"):
        block.insert(0, lines[index].strip().lstrip("#").strip())
        index -= 1
    return " ".join(block)


def _yaml_scalar(value: object) -> str:
    dumped: str = yaml.safe_dump(value, default_flow_style=True)
    return dumped.removesuffix("\n").removesuffix("\n...").strip()


def _documented_keys(
    model: type[BaseModel], node: yaml.MappingNode, lines: list[str], prefix: str
) -> list[tuple[str, FieldInfo, str]]:
    """(dotted path, field, comment) for every field of ``model`` found under ``node``, recursively."""
    found: list[tuple[str, FieldInfo, str]] = []
    for key_node, value_node in node.value:
        name = key_node.value
        field = _fields(model).get(name)
        if field is None:
            continue
        found.append((f"{prefix}{name}", field, _comment_above(lines, key_node.start_mark.line)))
        child = _item_model(field)
        if child is None:
            continue
        items = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
        for item in items:
            found += _documented_keys(child, item, lines, f"{prefix}{name}.")
    return found


def _all_field_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    paths: set[str] = set()
    for name, field in _fields(model).items():
        paths.add(f"{prefix}{name}")
        child = _item_model(field)
        if child is not None:
            paths |= _all_field_paths(child, f"{prefix}{name}.")
    return paths


def _example_documentation() -> list[tuple[str, FieldInfo, str]]:
    text = EXAMPLE.read_text()
    root = yaml.compose(text)
    assert isinstance(root, yaml.MappingNode)
    return _documented_keys(Settings, root, text.splitlines(), "")


def test_example_mentions_every_field() -> None:
    documented = {path for path, _, _ in _example_documentation()}
    assert _all_field_paths(Settings) - documented == set()


def test_example_comments_give_meaning_unit_and_default() -> None:
    # List items repeat keys; the first occurrence of each path carries the documentation.
    first: dict[str, tuple[FieldInfo, str]] = {}
    for path, field, comment in _example_documentation():
        first.setdefault(path, (field, comment))
    for path, (field, comment) in first.items():
        assert comment, f"{path}: no comment above the key"
        if path.endswith("_s"):
            assert "seconds" in comment, f"{path}: unit not stated"
        if path.endswith("_bytes"):
            assert "bytes" in comment, f"{path}: unit not stated"
        if field.is_required():
            assert "Required" in comment, f"{path}: not marked Required"
        elif field.default_factory is not None:
            # A built default (a map of classes, of tenants) is described, not dumped.
            assert "Default:" in comment, f"{path}: comment lacks a default"
        elif not isinstance(field.default, BaseModel):
            expected = f"Default: {_yaml_scalar(field.default)}"
            assert expected in comment, f"{path}: comment lacks {expected!r}"


def test_every_field_has_a_description() -> None:
    def missing(model: type[BaseModel], prefix: str = "") -> list[str]:
        out: list[str] = []
        for name, field in _fields(model).items():
            if not field.description:
                out.append(f"{prefix}{name}")
            child = _item_model(field)
            if child is not None:
                out += missing(child, f"{prefix}{name}.")
        return out

    assert missing(Settings) == []
