"""`sluice serve --replica URL` in front of a real vLLM (CPU build, tiny model), as a user runs it.

The gateway is a child process started from the URL alone, and the real ``openai`` SDK makes a
chat completion through it: the engine, the served model and its ``max_model_len`` come from the
replica. ``sluice config show --replica URL`` prints a configuration that ``load_settings``
accepts and that prints the same through ``--config``.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from gateway.config.load import load_settings
from tests.e2e.vllm_cpu import MAX_MODEL_LEN, SERVED_MODEL
from tests.integration.stack.conftest import _sluice
from tests.support.procs import Proc, free_port
from tests.support.speed import scaled

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180, func_only=True)]

MAX_TOKENS = 8


def _run(args: list[str], name: str) -> str:
    """The standard output (and error) of ``sluice ARGS``, which must exit 0."""
    proc = Proc([*_sluice(), *args], name=name)
    proc.popen.wait(scaled(60))
    assert proc.popen.returncode == 0, proc.output()
    return proc.output()


def test_serve_replica_answers_the_openai_sdk(vllm_base_url: str) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    gateway = Proc(
        [*_sluice(), "serve", "--replica", vllm_base_url, "--listen", f"127.0.0.1:{port}"], name="serve"
    )
    try:
        gateway.wait_http(base + "/readyz", timeout_s=scaled(60))
        client = openai.OpenAI(base_url=base + "/v1", api_key="not looked at", max_retries=0, timeout=120)
        (card,) = [m for m in client.models.list() if m.id == SERVED_MODEL]
        assert (card.model_extra or {}).get("max_model_len") == MAX_MODEL_LEN
        reply = client.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None
        assert reply.usage.completion_tokens == MAX_TOKENS
        out = gateway.output()
        assert f"({vllm_base_url}): vllm, serving {SERVED_MODEL} (max_model_len {MAX_MODEL_LEN})" in out
        assert out.count("no tenant is configured: Sluice authenticates no one") == 1
    finally:
        gateway.stop()


def test_config_show_loads_back_and_prints_the_same(vllm_base_url: str, tmp_path: Path) -> None:
    shown = _run(["config", "show", "--replica", vllm_base_url], "config-show")
    path = tmp_path / "sluice.yaml"
    path.write_text(shown, encoding="utf-8")

    settings = load_settings(path)
    (replica,) = settings.replicas
    assert (replica.url, replica.backend) == (vllm_base_url, "vllm")
    assert settings.tenants.tenants == {}
    assert _run(["config", "show", "--config", str(path)], "config-show-file") == shown
