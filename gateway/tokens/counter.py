"""A request's prompt counted with its model's tokenizer (``tokenizers``' ``Tokenizer``).

Completions (a string, or a list of strings: each counted, each a sequence of its own) and TGI's
``inputs`` are counted exactly as the engine tokenizes them: with the tokenizer's special tokens
(the BOS its post-processor adds) unless the body's ``add_special_tokens`` says otherwise. A chat
whose messages are text is rendered with the model's chat template when it has one
(``gateway.tokens.template``) and the result counted without special tokens, as vLLM does:
exact. Otherwise (no template, one that refuses the chat, message parts, tool calls, the
request's own ``chat_template``) a chat is counted approximately: every message's text, each
tool and tool call's JSON, plus ``CHAT_TOKENS_PER_MESSAGE`` per message and
``CHAT_TOKENS_PER_REQUEST`` for the template's markers. That total is close, not exact (a
template's own text, such as a default system prompt, is not in it), so its lowest plausible
count is the messages' text alone, which every template contains. Prompts the tokenizer cannot
count (images, audio, token ids) are ``None``: estimated as before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from tokenizers import Tokenizer

from gateway.api.openai import ParsedRequest
from gateway.tokens.template import ChatTemplate

__all__ = [
    "CHAT_TOKENS_PER_MESSAGE",
    "CHAT_TOKENS_PER_REQUEST",
    "OFF_LOOP_CHARS",
    "TEMPLATE_CHARS_PER_MESSAGE",
    "PromptCounter",
    "PromptTexts",
    "TokenCount",
    "prompt_texts",
]

#: Tokens a chat template wraps each message in: Llama 3's ``<|start_header_id|>``, the role,
#: ``<|end_header_id|>``, ``\n\n`` and ``<|eot_id|>``; Qwen's and ChatML's ``<|im_start|>``, the
#: role, ``\n``, ``<|im_end|>`` and ``\n`` (docs/predictor.md, "Prompt sizes").
CHAT_TOKENS_PER_MESSAGE: Final = 5
#: Tokens a chat template adds once: the BOS and the assistant's header it ends with
#: (``add_generation_prompt``): 1 + 4 for Llama 3, 3 for ChatML.
CHAT_TOKENS_PER_REQUEST: Final = 5
#: What rendering one message of a chat template costs, in characters of encoding (about 5 us).
TEMPLATE_CHARS_PER_MESSAGE: Final = 32
#: Prompt text (characters, all prompts together, plus ``TEMPLATE_CHARS_PER_MESSAGE`` per chat
#: message) above which counting runs in a worker thread:
#: encoding costs 0.2 to 0.5 us per character (docs/benchmarks.md, "Counting prompt tokens"), so
#: below it counting holds the event loop for at most a few hundred microseconds.
OFF_LOOP_CHARS: Final = 1024


@dataclass(frozen=True, slots=True)
class TokenCount:
    """A prompt counted with its tokenizer. ``tokens`` (>= 1): all its prompts together, a chat's
    template overhead included. ``fewest`` (1 <= fewest <= tokens): the lowest count the engine
    can arrive at for its longest sequence (the longest prompt of a list). ``exact``: ``tokens``
    is what the engine counts (completions), not a close approximation (chats)."""

    tokens: int
    fewest: int
    exact: bool


@dataclass(frozen=True, slots=True)
class PromptTexts:
    """What to encode: ``prompts`` (one per sequence) and, for a chat, the ``extra`` text
    (tools, tool calls), its ``messages`` count and the ``body`` a chat template may render
    (``None``: a chat no template can count exactly, or not a chat)."""

    prompts: list[str]
    add_special_tokens: bool
    chat: bool = False
    extra: list[str] | None = None
    messages: int = 0
    body: Mapping[str, Any] | None = None


def prompt_texts(parsed: ParsedRequest) -> PromptTexts | None:
    """The text of ``parsed``'s prompt(s), or ``None`` when a tokenizer cannot count it (token
    ids, a message part that is not text, a shape the replica will judge)."""
    body = parsed.body
    special = body.get("add_special_tokens")
    if parsed.endpoint == "chat":
        return _chat_texts(body, special if isinstance(special, bool) else False)
    add = special if isinstance(special, bool) else True
    if parsed.native:
        inputs = body.get("inputs")
        return PromptTexts([inputs], True) if isinstance(inputs, str) else None
    if parsed.prompt_token_ids is not None:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return PromptTexts([prompt], add)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return PromptTexts(list(prompt), add)
    return None


def _chat_texts(body: Mapping[str, Any], add_special_tokens: bool) -> PromptTexts | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    texts: list[str] = []
    extra: list[str] = []
    # A template renders the chat as vLLM would only for plain text messages and the server's
    # own template: vLLM reshapes parts and tool-call arguments before rendering.
    renderable = body.get("chat_template") is None and not body.get("continue_final_message")
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            renderable = False
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                    return None  # an image, audio or file: its tokens are the engine's to count
                texts.append(part["text"])
        elif content is not None:
            return None
        if message.get("tool_calls"):
            renderable = False
            extra.append(_json(message["tool_calls"]))
    if body.get("tools"):
        extra.append(_json(body["tools"]))
    return PromptTexts(
        texts,
        add_special_tokens,
        chat=True,
        extra=extra,
        messages=len(messages),
        body=body if renderable else None,
    )


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class PromptCounter:
    """Counts prompts with one ``Tokenizer`` and, for chats, its model's ``ChatTemplate`` when it
    has one. Thread-safe: ``count`` may run in a worker thread (``encode_batch_fast`` releases
    the GIL while it encodes)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None = None) -> None:
        self._tokenizer = tokenizer
        self._template = template

    def count(self, parsed: ParsedRequest) -> TokenCount | None:
        """``parsed``'s prompt counted (see the module), or ``None`` when it cannot be."""
        texts = prompt_texts(parsed)
        return None if texts is None else self.count_texts(texts)

    @staticmethod
    def weight(texts: PromptTexts) -> int:
        """What counting ``texts`` costs, in characters (compared with ``OFF_LOOP_CHARS``)."""
        chars = sum(map(len, texts.prompts)) + sum(map(len, texts.extra or ()))
        return chars + TEMPLATE_CHARS_PER_MESSAGE * texts.messages

    def count_texts(self, texts: PromptTexts) -> TokenCount:
        """``texts`` counted (``prompt_texts``' result)."""
        if texts.body is not None and self._template is not None:
            rendered = self._template.render(texts.body)
            if rendered is not None:
                (count,) = self._encode([rendered], add_special_tokens=texts.add_special_tokens)
                return TokenCount(max(count, 1), max(count, 1), True)
        counts = self._encode(texts.prompts, add_special_tokens=texts.add_special_tokens)
        if not texts.chat:
            total = max(sum(counts), 1)
            return TokenCount(total, min(max(max(counts, default=1), 1), total), True)
        content = sum(counts)
        extra = sum(self._encode(texts.extra or [], add_special_tokens=False))
        overhead = texts.messages * CHAT_TOKENS_PER_MESSAGE + CHAT_TOKENS_PER_REQUEST
        total = max(content + extra + overhead, 1)
        return TokenCount(total, min(max(content, 1), total), False)

    def _encode(self, texts: Sequence[str], *, add_special_tokens: bool) -> list[int]:
        if not texts:
            return []
        encodings = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        return [len(e.ids) for e in encodings]
