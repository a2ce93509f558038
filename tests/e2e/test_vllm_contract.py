"""What a real vLLM 0.32.0 answers, i.e. what the replica emulator must imitate.

Each exchange in ``tests.e2e.shapes.EXCHANGES`` is sent once to the session's real server; the
tests check the facts the gateway and the emulator rely on, and that the keys and types still match
``tests/e2e/data/vllm-0.32.0-shapes.json``. Re-record that file with
``SLUICE_RECORD_SHAPES=1 .venv/bin/python -m pytest tests/e2e/test_vllm_contract.py``: the run
fails when the file changed (review the diff, then re-run without the variable).
"""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any

import pytest

from tests.e2e.shapes import (
    EXCHANGES,
    SHAPES_PATH,
    Observation,
    describe,
    diff_shapes,
    load_shapes,
    metric_families,
    observe_http,
    sse_summary,
)
from tests.e2e.vllm_cpu import MAX_MODEL_LEN, MAX_NUM_SEQS, SERVED_MODEL, VLLM_VERSION

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120, func_only=True)]

RECORD_ENV = "SLUICE_RECORD_SHAPES"


@pytest.fixture(scope="module")
def observed(vllm_base_url: str) -> dict[str, Observation]:
    """Every exchange's answer from the real vLLM, by exchange name."""
    return {ex.name: observe_http(vllm_base_url, ex) for ex in EXCHANGES}


@pytest.fixture(scope="module")
def scrape(vllm_base_url: str, observed: dict[str, Observation]) -> str:
    """``/metrics`` text, taken after the exchanges so every labelled series exists."""
    with urllib.request.urlopen(vllm_base_url + "/metrics", timeout=30) as resp:
        return str(resp.read().decode())


@pytest.mark.parametrize(
    ("name", "status"),
    [(ex.name, 404 if "unknown_model" in ex.name else 400 if ex.name.startswith("error_") else 200)
     for ex in EXCHANGES],
    ids=[ex.name for ex in EXCHANGES],
)  # fmt: skip
def test_status(observed: dict[str, Observation], name: str, status: int) -> None:
    assert observed[name].status == status, observed[name].body[:300]


def test_version_is_pinned(observed: dict[str, Observation]) -> None:
    assert observed["version"].json() == {"version": VLLM_VERSION}


def test_models_lists_served_name_with_max_model_len(observed: dict[str, Observation]) -> None:
    body = observed["models"].json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [
        (SERVED_MODEL, "model", MAX_MODEL_LEN)
    ]


@pytest.mark.parametrize(
    ("name", "sequence"),
    [
        ("chat_stream_usage", ["role", "content+", "finish", "usage", "[DONE]"]),
        ("chat_stream", ["role", "content+", "finish", "[DONE]"]),
        ("completion_stream_usage", ["content+", "finish", "usage", "[DONE]"]),
    ],
    ids=["chat-include-usage", "chat-no-usage", "completion-include-usage"],
)
def test_sse_framing_and_chunk_order(
    observed: dict[str, Observation], name: str, sequence: list[str]
) -> None:
    seen = observed[name]
    assert seen.content_type == "text/event-stream; charset=utf-8"
    summary = sse_summary(seen.body)
    assert summary["framing_ok"], seen.body[:300]
    assert summary["done_last"]
    assert summary["sequence"] == sequence


@pytest.mark.parametrize("name", ["chat_stream_usage", "completion_stream_usage"])
def test_include_usage_final_chunk(observed: dict[str, Observation], name: str) -> None:
    events = observed[name].body.split(b"\n\n")
    usage_chunk = json.loads(events[-3].removeprefix(b"data: "))
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 8
    usage = usage_chunk["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert events[-2] == b"data: [DONE]"


@pytest.mark.parametrize("name", ["chat", "completion"])
def test_non_streaming_usage_counts_ignore_eos_tokens(observed: dict[str, Observation], name: str) -> None:
    body = observed[name].json()
    assert body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("name", "error_type", "param"),
    [
        ("error_unknown_model", "NotFoundError", "model"),
        ("error_max_tokens_over_max_model_len", "BadRequestError", "max_tokens"),
        ("error_invalid_json", "Bad Request", None),
    ],
    ids=["unknown-model", "max-tokens-over-limit", "invalid-json"],
)
def test_error_body(observed: dict[str, Observation], name: str, error_type: str, param: str | None) -> None:
    seen = observed[name]
    assert seen.content_type == "application/json"
    error = seen.json()["error"]
    assert sorted(error) == ["code", "message", "param", "type"]
    assert (error["type"], error["code"]) == (error_type, seen.status)
    assert isinstance(error["message"], str)
    assert error["message"]
    if param is not None:
        assert error["param"] == param


def test_prompt_plus_max_tokens_over_limit_is_capped_not_rejected(observed: dict[str, Observation]) -> None:
    body = observed["prompt_plus_max_tokens_over_max_model_len"].json()
    assert body["usage"]["total_tokens"] == MAX_MODEL_LEN
    assert body["choices"][0]["finish_reason"] == "length"


def record(observed: dict[str, Observation], scrape: str) -> dict[str, Any]:
    """The whole fixture file's content, from this session's observations."""
    return {
        "vllm_version": VLLM_VERSION,
        "about": "Keys and JSON types (not values) of a real vLLM's answers; written by "
        "tests/e2e/test_vllm_contract.py with SLUICE_RECORD_SHAPES=1. Shapes: see tests/e2e/shapes.py.",
        "server": {
            "served_model_name": SERVED_MODEL,
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS,
            "model": "tiny random Llama from deploy/vllm-cpu/build_tiny_model.py",
        },
        "exchanges": {ex.name: describe(ex, observed[ex.name]) for ex in EXCHANGES},
        "metrics": metric_families(scrape),
    }


def test_shapes_match_recorded_fixture(observed: dict[str, Observation], scrape: str) -> None:
    """The shapes match the committed file. In record mode (``SLUICE_RECORD_SHAPES=1``) the file is
    rewritten, and the test still compares with the copy read before the write: it passes only
    when nothing changed, and otherwise fails, listing what did, until re-run without record mode."""
    current = record(observed, scrape)
    recorded = load_shapes() if SHAPES_PATH.is_file() else None
    if os.environ.get(RECORD_ENV) == "1":
        SHAPES_PATH.parent.mkdir(parents=True, exist_ok=True)
        SHAPES_PATH.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
        if recorded is None:
            pytest.fail(f"recorded {SHAPES_PATH} (there was none): re-run without {RECORD_ENV}=1")
        if current != recorded:
            changed = "\n".join(diff_shapes(recorded, current, null_matches=False))
            pytest.fail(
                f"recorded {SHAPES_PATH.name} anew; what changed (review it with git diff, then "
                f"re-run without {RECORD_ENV}=1):\n{changed}"
            )
    assert recorded is not None, f"{SHAPES_PATH} missing: run with {RECORD_ENV}=1 to record it"
    # Same vLLM version, same requests: everything recorded (shapes, statuses, chunk order) must hold.
    differences = "\n".join(diff_shapes(recorded, current, null_matches=False))
    assert current == recorded, f"real vLLM no longer matches {SHAPES_PATH.name}:\n{differences}"
