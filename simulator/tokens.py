r"""Deterministic token counting and fake generated text, with no tokenizer model.

The emulator must agree with itself, not with a real tokenizer. Each word and each punctuation
mark (regex ``\w+|[^\w\s]``) is one token; a completion prompt adds ``BOS_TOKENS``; a chat prompt
adds ``BOS_TOKENS``, ``CHAT_TOKENS_PER_MESSAGE`` per message and
``CHAT_GENERATION_PROMPT_TOKENS``; token-id prompts count their ids exactly. Every generated token
is one fake word.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Mapping, Sequence

#: Tokens a tokenizer adds in front of a text prompt (``<s>``).
BOS_TOKENS = 1
#: Template tokens around one chat message (role marker, newline, end-of-turn).
CHAT_TOKENS_PER_MESSAGE = 4
#: Template tokens that open the assistant turn the model generates.
CHAT_GENERATION_PROMPT_TOKENS = 3
#: Size of the notional vocabulary fake token ids are drawn from.
VOCAB_SIZE = 32_000

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")

# Short common words, so fake text looks like text and every token is exactly one word.
_WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "model", "token", "batch",
    "step", "queue", "cache", "block", "prefill", "decode", "request", "replica", "latency",
    "sluice", "river", "stone", "water", "light", "paper", "garden", "window", "market", "signal",
)  # fmt: skip
#: Step through ``_WORDS`` per token; coprime with ``len(_WORDS)`` (checked in the unit tests).
_STRIDE = 37


def split_text(text: str) -> list[str]:
    """The pieces of ``text`` that each count as one token (words and punctuation marks)."""
    return _TOKEN_RE.findall(text)


def count_text_tokens(text: str) -> int:
    """Tokens in ``text`` alone, without BOS or template tokens (0 for blank text)."""
    return len(split_text(text))


def count_completion_prompt(prompt: str | Sequence[int]) -> int:
    """Prompt tokens of a completion request: a text (plus BOS) or a list of token ids."""
    if isinstance(prompt, str):
        return BOS_TOKENS + count_text_tokens(prompt)
    return len(prompt)


def message_text(content: object) -> str:
    """The text of one chat message's ``content``: a string, or the ``text`` of its parts.

    Non-text parts (images, audio) contribute nothing: the emulator serves a text model.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, Iterable):
        texts = [
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        ]
        return " ".join(texts)
    return ""


def count_chat_prompt(messages: Sequence[Mapping[str, object]]) -> int:
    """Prompt tokens of a chat request after the notional chat template is applied."""
    per_message = sum(
        CHAT_TOKENS_PER_MESSAGE + count_text_tokens(message_text(m.get("content"))) for m in messages
    )
    return BOS_TOKENS + per_message + CHAT_GENERATION_PROMPT_TOKENS


def text_seed(text: str) -> int:
    """A stable 32-bit seed for ``text`` (same on every run and platform, unlike ``hash``)."""
    return zlib.crc32(text.encode("utf-8"))


def fake_token_ids(text: str) -> list[int]:
    """Stable fake token ids for ``text``, one per piece of :func:`split_text`."""
    return [zlib.crc32(piece.encode("utf-8")) % VOCAB_SIZE for piece in split_text(text)]


def fake_word(seed: int, index: int) -> str:
    """The ``index``-th generated token (0-based) of a request seeded with ``seed``.

    Every token is one word with a leading space, so ``n`` tokens join into ``n`` words.
    """
    # A stride coprime with the word count walks the whole list before repeating.
    return " " + _WORDS[(seed + index * _STRIDE) % len(_WORDS)]


def fake_text(seed: int, start: int, count: int) -> str:
    """Generated tokens ``start .. start+count-1`` of a request, concatenated."""
    return "".join(fake_word(seed, i) for i in range(start, start + count))
