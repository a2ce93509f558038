"""What a real vLLM 0.32.0 reports about its prefix cache: ``usage.prompt_tokens_details`` with
``--enable-prompt-tokens-details``, and the prefix-cache counters, for the emulator to imitate;
and Sluice in front of it expecting the hits vLLM then reports.

A server of its own (the session's runs without the flag) answers the exchanges of
``tests.e2e.prefix_cache_exchanges`` in order. The facts checked here are vLLM's rules (only full
blocks hit, the last prompt token never does, counters in tokens); the answers are compared with
``tests/e2e/data/vllm-0.32.0-prefix-cache.json``. Record that file with
``SLUICE_RECORD=1 .venv/bin/python -m pytest tests/e2e/test_prefix_cache_real_vllm.py``: the run
fails when the file changed (review the diff, then re-run without the variable).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from tests.e2e.conftest import serving
from tests.e2e.prefix_cache_exchanges import (
    RECORDING_PATH,
    SHARED_IDS,
    load_recording,
    observe,
)
from tests.e2e.vllm_cpu import CACHE, MODEL_DIR, SERVED_MODEL, VLLM_VERSION, VllmServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300, func_only=True)]

RECORD_ENV = "SLUICE_RECORD"
FLAGS = ("--enable-prompt-tokens-details",)


@pytest.fixture(scope="module")
def server(vllm_installed: None) -> Iterator[VllmServer]:
    """A real vLLM with ``--enable-prompt-tokens-details`` (prefix caching on: vLLM's default)."""
    yield from serving(log_path=CACHE / "server-prefix-cache.log", extra_args=FLAGS)


@pytest.fixture(scope="module")
def observed(server: VllmServer) -> dict[str, Any]:
    return {
        "vllm_version": VLLM_VERSION,
        "about": "A real vLLM's usage and prefix-cache counters for the exchanges of "
        "tests/e2e/prefix_cache_exchanges.py; written by tests/e2e/test_prefix_cache_real_vllm.py "
        f"with {RECORD_ENV}=1. Server flags: {' '.join(FLAGS)}.",
        **observe(server.base_url, SERVED_MODEL),
    }


def test_warm_completion_hits_its_full_blocks_but_never_the_last_token(observed: dict[str, Any]) -> None:
    block = observed["block_size"]
    usage = observed["usage"]
    assert usage["completion_cold"]["prompt_tokens"] == len(SHARED_IDS)
    assert usage["completion_cold"]["prompt_tokens_details"]["cached_tokens"] == 0
    expected = (len(SHARED_IDS) - 1) // block * block
    assert usage["completion_warm"]["prompt_tokens_details"]["cached_tokens"] == expected
    assert usage["completion_stream_warm"]["prompt_tokens_details"]["cached_tokens"] == expected


def test_chat_hits_are_whole_blocks(observed: dict[str, Any]) -> None:
    block = observed["block_size"]
    cached = observed["usage"]["chat_warm"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert cached % block == 0


def test_counters_count_tokens(observed: dict[str, Any]) -> None:
    increase = observed["counter_increase"]
    usage = observed["usage"]
    assert increase["vllm:prefix_cache_queries"] == sum(u["prompt_tokens"] for u in usage.values())
    hits = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage.values())
    assert increase["vllm:prefix_cache_hits"] == hits == increase["vllm:prompt_tokens_cached"]


def test_matches_recording(observed: dict[str, Any]) -> None:
    """The answers match the committed recording. With ``SLUICE_RECORD=1`` the file is rewritten
    and the test fails when it changed, until re-run without the variable."""
    recorded = load_recording()
    if os.environ.get(RECORD_ENV) == "1":
        RECORDING_PATH.write_text(json.dumps(observed, indent=1, sort_keys=True) + "\n")
        if recorded != observed:
            pytest.fail(f"recorded {RECORDING_PATH.name} anew: review it, then re-run without {RECORD_ENV}=1")
    assert recorded is not None, f"{RECORDING_PATH} missing: run with {RECORD_ENV}=1 to record it"
    assert observed == recorded


#: A system prompt none of the exchanges above sent (about 700 characters: four to five of
#: vLLM's 128-token CPU blocks for the tiny model's tokenizer).
SLUICE_SYSTEM = " ".join(f"clause {i}: keep every answer short and name each source." for i in range(12))


async def test_sluice_expects_the_hits_vllm_reports(
    server: VllmServer, observed: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Sluice in front of the real vLLM (its tokenizer given, so prompts are counted exactly):
    a chat sent cold expects no hit and vLLM reports none; the same system prompt with other
    questions expects the hit vLLM reports, within one of its blocks plus a fifth of the prompt
    (Sluice's blocks are of text, vLLM's of tokens)."""
    block = observed["block_size"]
    settings = Settings.model_validate(
        {
            "server": {"host": "127.0.0.1", "port": 0},
            "replicas": [{"name": "vllm-cpu", "url": server.base_url, "tokenizer": str(MODEL_DIR)}],
            "health": {"interval_s": 5.0, "timeout_s": 5.0},
            "reload": {"watch": False},
        }
    )
    runner = web.AppRunner(build_app(SettingsStore(settings)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    base = f"http://{host}:{port}"
    questions = ["What is a sluice?", "What is a weir?", "What is a lock?", "What is a dam?"]
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(300):  # the health checker lists the model (up to 30 s)
                async with session.get(base + "/v1/models") as resp:
                    if resp.status == 200 and SERVED_MODEL in str(await resp.json()):
                        break
                await asyncio.sleep(0.1)
            with caplog.at_level(logging.INFO, logger="sluice.access"):
                for question in questions:
                    body = {
                        "model": SERVED_MODEL,
                        "max_tokens": 4,
                        "messages": [
                            {"role": "system", "content": SLUICE_SYSTEM},
                            {"role": "user", "content": question},
                        ],
                    }
                    async with session.post(base + "/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()
    finally:
        await runner.cleanup()
    lines = [r.fields for r in caplog.records if r.name == "sluice.access" and hasattr(r, "fields")]
    chats = [f for f in lines if f["path"] == "/v1/chat/completions"]
    assert len(chats) == len(questions), lines
    cold, *warm = chats
    assert (cold["expected_cached_tokens"], cold["cached_tokens"]) == (0, 0), cold
    for line in warm:
        reported, expected = line["cached_tokens"], line["expected_cached_tokens"]
        assert reported > 0, line
        assert reported % block == 0, line
        assert abs(expected - reported) <= block + line["prompt_tokens"] // 5, line
