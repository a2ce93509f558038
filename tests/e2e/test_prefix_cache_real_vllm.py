"""What a real vLLM 0.32.0 reports about its prefix cache: ``usage.prompt_tokens_details`` with
``--enable-prompt-tokens-details``, and the prefix-cache counters, for the emulator to imitate.

A server of its own (the session's runs without the flag) answers the exchanges of
``tests.e2e.prefix_cache_exchanges`` in order. The facts checked here are vLLM's rules (only full
blocks hit, the last prompt token never does, counters in tokens); the answers are compared with
``tests/e2e/data/vllm-0.32.0-prefix-cache.json``. Record that file with
``SLUICE_RECORD=1 .venv/bin/python -m pytest tests/e2e/test_prefix_cache_real_vllm.py``: the run
fails when the file changed (review the diff, then re-run without the variable).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import serving
from tests.e2e.prefix_cache_exchanges import (
    RECORDING_PATH,
    SHARED_IDS,
    load_recording,
    observe,
)
from tests.e2e.vllm_cpu import CACHE, SERVED_MODEL, VLLM_VERSION, VllmServer

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
