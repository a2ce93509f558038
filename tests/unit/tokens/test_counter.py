"""Prompts counted with a real tokenizer (the e2e tiny model's BPE, trained offline): what the
engine counts for completions, the chat template's overhead for chats, nothing for what a text
tokenizer cannot count."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from gateway.api.openai import parse_request
from gateway.tokens.counter import (
    CHAT_TOKENS_PER_MESSAGE,
    CHAT_TOKENS_PER_REQUEST,
    PromptCounter,
    TokenCount,
)
from gateway.tokens.template import load_chat_template
from tests.support.tokenizer import tokenizer

TEXT = "Sluice admits each request whose forecast meets its targets, or queues it."
OTHER = "A replica refuses prompts longer than its context."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tokenizer()


def count(tok: Tokenizer, endpoint: str, body: dict[str, Any]) -> TokenCount | None:
    parsed = parse_request(endpoint, json.dumps({"model": "m", **body}).encode())  # type: ignore[arg-type]
    return PromptCounter(tok).count(parsed)


def n(tok: Tokenizer, text: str, *, special: bool) -> int:
    return len(tok.encode(text, add_special_tokens=special).ids)


def test_a_completion_is_counted_exactly_with_its_bos(tok: Tokenizer) -> None:
    exact = n(tok, TEXT, special=True)
    assert exact == n(tok, TEXT, special=False) + 1  # the <s> post-processor
    assert count(tok, "completions", {"prompt": TEXT}) == TokenCount(exact, exact, True)


def test_add_special_tokens_false_is_honoured(tok: Tokenizer) -> None:
    plain = n(tok, TEXT, special=False)
    body = {"prompt": TEXT, "add_special_tokens": False}
    assert count(tok, "completions", body) == TokenCount(plain, plain, True)


def test_each_prompt_of_a_list_is_counted_and_the_longest_must_fit(tok: Tokenizer) -> None:
    a, b = n(tok, TEXT, special=True), n(tok, OTHER, special=True)
    assert count(tok, "completions", {"prompt": [TEXT, OTHER]}) == TokenCount(a + b, max(a, b), True)


def test_a_chat_adds_the_templates_overhead_and_is_at_least_its_text(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": OTHER},
        {"role": "user", "content": [{"type": "text", "text": TEXT}]},
    ]
    text = n(tok, OTHER, special=False) + n(tok, TEXT, special=False)
    overhead = 2 * CHAT_TOKENS_PER_MESSAGE + CHAT_TOKENS_PER_REQUEST
    assert count(tok, "chat", {"messages": messages}) == TokenCount(text + overhead, text, False)


def test_tools_and_tool_calls_are_counted_as_their_json(tok: Tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    messages = [
        {"role": "user", "content": TEXT},
        {"role": "assistant", "content": None, "tool_calls": calls},
    ]
    counted = count(tok, "chat", {"messages": messages, "tools": tools})
    assert counted is not None
    as_json = sum(n(tok, json.dumps(v, separators=(",", ":")), special=False) for v in (calls, tools))
    text = n(tok, TEXT, special=False)
    overhead = 2 * CHAT_TOKENS_PER_MESSAGE + CHAT_TOKENS_PER_REQUEST
    assert counted == TokenCount(text + as_json + overhead, text, False)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        pytest.param("completions", {"prompt": [1, 2, 3]}, id="token-ids"),
        pytest.param("completions", {"prompt": [[1, 2], [3]]}, id="lists-of-token-ids"),
        pytest.param(
            "chat",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": TEXT},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        ],
                    }
                ]
            },
            id="an-image",
        ),
    ],
)
def test_what_a_text_tokenizer_cannot_count_is_left_to_the_estimate(
    tok: Tokenizer, endpoint: str, body: dict[str, Any]
) -> None:
    assert count(tok, endpoint, body) is None


def templated(tok: Tokenizer, tmp_path: Path, **files: str) -> PromptCounter:
    for name, content in files.items():
        (tmp_path / name.replace("__", ".")).write_text(content, encoding="utf-8")
    return PromptCounter(tok, load_chat_template(tmp_path))


#: The e2e tiny model's template (deploy/vllm-cpu/build_tiny_model.py), with a BOS from the config.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.mark.parametrize(
    "files",
    [
        pytest.param(
            {"tokenizer_config__json": json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>"})},
            id="tokenizer-config",
        ),
        pytest.param(
            {
                "tokenizer_config__json": json.dumps(
                    {
                        "chat_template": [{"name": "default", "template": TEMPLATE}],
                        "bos_token": {"content": "<s>"},
                    }
                )
            },
            id="named-templates",
        ),
        pytest.param(
            {"chat_template__jinja": TEMPLATE, "tokenizer_config__json": json.dumps({"bos_token": "<s>"})},
            id="chat-template-jinja",
        ),
    ],
)
def test_a_chat_rendered_with_its_template_is_counted_exactly(
    tok: Tokenizer, tmp_path: Path, files: dict[str, str]
) -> None:
    counter = templated(tok, tmp_path, **files)
    messages = [{"role": "system", "content": OTHER}, {"role": "user", "content": TEXT}]
    rendered = f"<s><|system|>\n{OTHER}\n<|user|>\n{TEXT}\n<|assistant|>\n"
    exact = n(tok, rendered, special=False)
    parsed = parse_request("chat", json.dumps({"model": "m", "messages": messages}).encode())
    assert counter.count(parsed) == TokenCount(exact, exact, True)
    body = {"model": "m", "messages": messages, "add_generation_prompt": False}
    without = n(tok, rendered.removesuffix("<|assistant|>\n"), special=False)
    assert counter.count(parse_request("chat", json.dumps(body).encode())) == TokenCount(
        without, without, True
    )


@pytest.mark.parametrize(
    ("template", "extra"),
    [
        pytest.param("{{ raise_exception('roles must alternate') }}", {}, id="template-refuses"),
        pytest.param(TEMPLATE, {"chat_template": "{{ messages }}"}, id="the-requests-own-template"),
    ],
)
def test_a_chat_the_template_cannot_count_is_counted_approximately(
    tok: Tokenizer, tmp_path: Path, template: str, extra: dict[str, Any]
) -> None:
    counter = templated(tok, tmp_path, tokenizer_config__json=json.dumps({"chat_template": template}))
    body = {"model": "m", "messages": [{"role": "user", "content": TEXT}], **extra}
    text = n(tok, TEXT, special=False)
    approximate = TokenCount(text + CHAT_TOKENS_PER_MESSAGE + CHAT_TOKENS_PER_REQUEST, text, False)
    assert counter.count(parse_request("chat", json.dumps(body).encode())) == approximate


def test_a_template_that_does_not_compile_is_no_template(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for %}"}), encoding="utf-8"
    )
    assert load_chat_template(tmp_path) is None
    assert load_chat_template(tmp_path / "missing") is None
