"""The prefix-cache exchanges: what a real vLLM (``--enable-prompt-tokens-details``, prefix caching
on, its default) answers in ``usage`` and how its prefix-cache counters move, for the emulator to
imitate.

``tests/e2e/test_prefix_cache_real_vllm.py`` records a real vLLM's answers into
:data:`RECORDING_PATH` (with ``SLUICE_RECORD=1``); ``tests/contract/test_prefix_cache_contract.py``
replays the same exchanges against the emulator and compares. Completions send token ids, so
both sides hash the same tokens and the cached counts must agree exactly; chats send text, which
the two tokenise differently, so only their shapes are compared.

Pure Python and the standard library only: importable from any test.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORDING_PATH = Path(__file__).resolve().parent / "data" / "vllm-0.32.0-prefix-cache.json"

#: 300 token ids, inside any Llama vocabulary: 2 full blocks of 128 (vLLM's CPU block size) + 44.
SHARED_IDS: list[int] = [1000 + i for i in range(300)]
#: About 700 characters: more than one block of 128 tokens for the emulator (156 tokens) and for
#: the tiny model's byte-level BPE, and within its 1024-token context even at a token per byte.
SYSTEM_TEXT = " ".join(f"rule {i}: answer briefly and cite the source of every fact." for i in range(12))


@dataclass(frozen=True)
class CacheExchange:
    """One request of the sequence; they run in order, each after the previous one finished."""

    name: str
    path: str
    body: dict[str, Any]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def _completion(**extra: Any) -> dict[str, Any]:
    return {"prompt": SHARED_IDS, "max_tokens": 4, "ignore_eos": True, **extra}


def _chat(question: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": question}]
    return {"messages": messages, "max_tokens": 4, "ignore_eos": True, **extra}


STREAM_USAGE = {"stream": True, "stream_options": {"include_usage": True}}

EXCHANGES: tuple[CacheExchange, ...] = (
    CacheExchange("completion_cold", "/v1/completions", _completion()),
    CacheExchange("completion_warm", "/v1/completions", _completion()),
    CacheExchange("completion_stream_warm", "/v1/completions", _completion(**STREAM_USAGE)),
    CacheExchange("chat_cold", "/v1/chat/completions", _chat("What is a sluice?")),
    CacheExchange("chat_warm", "/v1/chat/completions", _chat("What is a weir?")),
    CacheExchange("chat_stream_warm", "/v1/chat/completions", _chat("What is a lock?", **STREAM_USAGE)),
)
#: Exchanges whose values (not only shapes) must match: token-id prompts.
EXACT = ("completion_cold", "completion_warm", "completion_stream_warm")

#: The counters whose increase over the exchanges is recorded (parsed names, without ``_total``).
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_cached",
)


def usage_of(body: bytes, *, stream: bool) -> Any:
    """The ``usage`` of a whole body, or of a stream's usage chunk (the last before ``[DONE]``)."""
    if not stream:
        return json.loads(body)["usage"]
    events = [e for e in body.split(b"\n\n") if e.startswith(b"data: ") and e != b"data: [DONE]"]
    return json.loads(events[-1].removeprefix(b"data: "))["usage"]


def counters(metrics_text: str) -> dict[str, float]:
    """The :data:`COUNTERS` of a ``/metrics`` text, summed over their series."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        if family.name in totals:
            totals[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


def block_size(metrics_text: str) -> int:
    """``block_size`` of ``vllm:cache_config_info``."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return int(line.split('block_size="', 1)[1].split('"', 1)[0])
    raise ValueError("no vllm:cache_config_info in the scrape")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(resp.read().decode())


def observe(base_url: str, model: str) -> dict[str, Any]:
    """Run :data:`EXCHANGES` in order against ``base_url``; the recording's content."""
    before = _get(base_url + "/metrics")
    usages: dict[str, Any] = {}
    for exchange in EXCHANGES:
        data = json.dumps({"model": model, **exchange.body}).encode()
        request = urllib.request.Request(
            base_url + exchange.path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            usages[exchange.name] = usage_of(resp.read(), stream=exchange.stream)
    after = _get(base_url + "/metrics")
    start, end = counters(before), counters(after)
    return {
        "block_size": block_size(after),
        "usage": usages,
        "counter_increase": {name: end[name] - start[name] for name in COUNTERS},
    }


def load_recording(path: Path = RECORDING_PATH) -> dict[str, Any] | None:
    """The recorded real answers, or None while the recording is still to be made."""
    if not path.is_file():
        return None
    recorded: dict[str, Any] = json.loads(path.read_text())
    return recorded
