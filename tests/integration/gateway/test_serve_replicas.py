"""`sluice serve --replica URL` and `sluice config init` in front of running replicas, as processes.

Two emulated replicas (vLLM and SGLang look-alikes) stand in for a fleet someone else runs: the
starter YAML names each one's engine, model and the limits SGLang exposes, and loads back; the
gateway started from the URLs alone (flags, or the environment as in a container) serves the
``openai`` SDK, says once that it authenticates no one, and with the demo tenant asks for a key.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from gateway.config.load import load_settings
from tests.integration.stack.conftest import _first_model, _sluice
from tests.support.procs import Proc, free_port, python_module
from tests.support.speed import scaled

pytestmark = pytest.mark.timeout(120)

#: The profile both emulators run, and what its `engine:` section says SGLang was launched with.
PROFILE = "llama3-8b-h100"
PROFILE_MAX_NUM_SEQS = 1024
PROFILE_MAX_NUM_BATCHED_TOKENS = 8192
NO_TENANT_WARNING = "no tenant is configured: Sluice authenticates no one"


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, str]]:
    """Base URLs of a running emulated vLLM and SGLang replica, by engine."""
    ports = {"vllm": free_port(), "sglang": free_port()}
    procs = [
        Proc(
            python_module(
                "simulator", "--profile", PROFILE, "--engine", engine, "--port", str(port), "--seed", "1"
            ),
            name=f"emu-{engine}",
        )
        for engine, port in ports.items()
    ]
    try:
        for proc, port in zip(procs, ports.values(), strict=True):
            proc.wait_http(f"http://127.0.0.1:{port}/health")
        yield {engine: f"http://127.0.0.1:{port}" for engine, port in ports.items()}
    finally:
        for proc in procs:
            proc.stop()


def _run(args: list[str], name: str, env: dict[str, str] | None = None) -> Proc:
    proc = Proc([*_sluice(), *args], name=name, env=env)
    proc.popen.wait(scaled(30))
    return proc


def test_config_init_writes_what_each_replica_said(fleet: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "sluice.yaml"
    proc = _run(
        ["config", "init", "--replica", fleet["vllm"], "--replica", fleet["sglang"], "--write", str(path)],
        "init",
    )
    assert proc.popen.returncode == 0, proc.output()

    text = path.read_text(encoding="utf-8")
    settings = load_settings(path)
    vllm, sglang = settings.replicas
    assert (vllm.url, vllm.backend, vllm.hardware.model) == (
        fleet["vllm"],
        "vllm",
        "meta-llama/Meta-Llama-3-8B-Instruct",
    )
    assert (sglang.url, sglang.backend) == (fleet["sglang"], "sglang")
    assert sglang.hardware.max_num_seqs == PROFILE_MAX_NUM_SEQS
    assert sglang.hardware.max_num_batched_tokens == PROFILE_MAX_NUM_BATCHED_TOKENS
    assert vllm.hardware.gpu is None  # no engine exposes it: the header says to write it
    assert "(max_model_len 8192)" in text
    assert "hardware.gpu" in text
    assert settings.authenticates_no_one
    assert "server" not in yaml.safe_load(text)  # the default listener, 127.0.0.1:8080

    again = _run(["config", "init", "--replica", fleet["vllm"], "--write", str(path)], "init-again")
    assert again.popen.returncode == 2
    assert "exists" in again.output()


def test_serve_from_urls_alone_serves_the_openai_sdk(fleet: dict[str, str]) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    gateway = Proc(
        [
            *_sluice(),
            "serve",
            "--replica",
            fleet["vllm"],
            "--replica",
            fleet["sglang"],
            "--listen",
            f"127.0.0.1:{port}",
        ],
        name="serve-replicas",
    )
    try:
        gateway.wait_http(base + "/readyz", timeout_s=scaled(60))
        model = _first_model(base)
        for _ in range(2):  # one on each replica (least outstanding, ties round robin)
            assert _chat(base, "any key at all", model) > 0
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        (listed,) = [m for m in client.models.list() if m.id == model]
        assert (listed.model_extra or {}).get("max_model_len") == 8192
        out = gateway.output()
        assert out.count(NO_TENANT_WARNING) == 1
        assert next(line for line in out.splitlines() if NO_TENANT_WARNING in line).split()[2] == "WARNING"
        assert f"({fleet['sglang']}): sglang, serving {model}" in out
    finally:
        gateway.stop()


def _chat(base: str, api_key: str, model: str) -> int:
    """Completion tokens of one short chat completion through the gateway at ``base``."""
    client = openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": "Hello!"}]
    )
    assert reply.usage is not None
    return reply.usage.completion_tokens


def test_serve_from_the_environment_with_the_demo_tenant(fleet: dict[str, str]) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"SLUICE_REPLICAS": fleet["vllm"], "SLUICE_LISTEN": f"127.0.0.1:{port}", "SLUICE_DEMO_TENANT": "1"}
    gateway = Proc([*_sluice(), "serve"], name="serve-env", env=env)
    try:
        gateway.wait_http(base + "/readyz", timeout_s=scaled(60))
        model = _first_model(base, key="sk-demo")
        with pytest.raises(openai.AuthenticationError):
            _chat(base, "sk-wrong", model)
        assert _chat(base, "sk-demo", model) > 0
        assert NO_TENANT_WARNING not in gateway.output()
    finally:
        gateway.stop()
