r"""Deterministic token counting and fake generated text, with no tokenizer model.

The emulator must agree with itself, not with a real tokenizer. Each word and each punctuation
mark (regex ``\w+|[^\w\s]``) is one token; a completion prompt adds ``BOS_TOKENS``; a chat prompt
adds ``BOS_TOKENS``, ``CHAT_TOKENS_PER_MESSAGE`` per message and
``CHAT_GENERATION_PROMPT_TOKENS``; token-id prompts count their ids exactly. Every generated token
is one fake word.

The same prompts also have fake token ids (``completion_prompt_ids``, ``chat_prompt_ids``), one
per counted token, for the prefix cache: the same text gives the same ids, and a chat's next turn
(its history plus the answer just generated) starts with exactly the ids of the turn before it
and of that answer (``fake_word_id``), as a real chat template and tokenizer mostly do.
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
#: Fake id of BOS (Llama's).
BOS_ID = 1
#: Fake ids of the chat template's tokens (above the vocabulary, so no text piece has them).
TURN_START_ID = VOCAB_SIZE + 1
NEWLINE_ID = VOCAB_SIZE + 2
TURN_END_ID = VOCAB_SIZE + 3

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
#: ``_WORDS``' token ids.
_WORD_IDS: tuple[int, ...] = tuple(zlib.crc32(word.encode("utf-8")) % VOCAB_SIZE for word in _WORDS)


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
    return [_piece_id(piece) for piece in split_text(text)]


def _piece_id(piece: str) -> int:
    return zlib.crc32(piece.encode("utf-8")) % VOCAB_SIZE


def completion_prompt_ids(prompt: str | Sequence[int]) -> list[int]:
    """Fake token ids of a completion prompt: BOS and the text's ids, or the given ids;
    ``len`` equals :func:`count_completion_prompt`."""
    if isinstance(prompt, str):
        return [BOS_ID, *fake_token_ids(prompt)]
    return list(prompt)


def chat_prompt_ids(messages: Sequence[Mapping[str, object]]) -> list[int]:
    """Fake token ids of a chat prompt after the notional template: BOS, then per message
    ``TURN_START role NEWLINE text TURN_END``, then ``TURN_START assistant NEWLINE``; ``len``
    equals :func:`count_chat_prompt`."""
    ids = [BOS_ID]
    for message in messages:
        ids += [TURN_START_ID, _piece_id(str(message.get("role", ""))), NEWLINE_ID]
        ids += fake_token_ids(message_text(message.get("content")))
        ids.append(TURN_END_ID)
    ids += [TURN_START_ID, _piece_id("assistant"), NEWLINE_ID]
    return ids


def fake_word_id(seed: int, index: int) -> int:
    """The token id of :func:`fake_word` ``(seed, index)``, as :func:`fake_token_ids` reads it."""
    return _WORD_IDS[(seed + index * _STRIDE) % len(_WORDS)]


def fake_word(seed: int, index: int) -> str:
    """The ``index``-th generated token (0-based) of a request seeded with ``seed``.

    Every token is one word with a leading space, so ``n`` tokens join into ``n`` words.
    """
    # A stride coprime with the word count walks the whole list before repeating.
    return " " + _WORDS[(seed + index * _STRIDE) % len(_WORDS)]


def fake_text(seed: int, start: int, count: int) -> str:
    """Generated tokens ``start .. start+count-1`` of a request, concatenated."""
    return "".join(fake_word(seed, i) for i in range(start, start + count))
