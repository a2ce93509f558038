"""Token counting and fake text: deterministic, one word per token."""

from __future__ import annotations

import math

import pytest

from simulator import tokens


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("", 0, id="empty"),
        pytest.param("   \n\t", 0, id="blank"),
        pytest.param("hello", 1, id="one-word"),
        pytest.param("Hello, world!", 4, id="punctuation-counts"),
        pytest.param("snake_case and 42 numbers", 4, id="underscore-and-digits-are-word-chars"),
        pytest.param("naïve café", 2, id="unicode-words"),
    ],
)
def test_count_text_tokens(text: str, expected: int) -> None:
    assert tokens.count_text_tokens(text) == expected


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        pytest.param("Hello, world!", 4 + tokens.BOS_TOKENS, id="text-gets-bos"),
        pytest.param([5, 6, 7], 3, id="token-ids-exact"),
        pytest.param([0], 1, id="single-id"),
    ],
)
def test_count_completion_prompt(prompt: str | list[int], expected: int) -> None:
    assert tokens.count_completion_prompt(prompt) == expected


@pytest.mark.parametrize(
    ("messages", "content_tokens"),
    [
        pytest.param([], 0, id="no-messages"),
        pytest.param([{"role": "user", "content": "hi there"}], 2, id="one-string-message"),
        pytest.param(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}],
            4,
            id="two-messages",
        ),
        pytest.param(
            [{"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "image_url"}]}],
            2,
            id="content-parts-text-only",
        ),
        pytest.param([{"role": "assistant", "content": None}], 0, id="null-content"),
    ],
)
def test_count_chat_prompt_adds_template_tokens(
    messages: list[dict[str, object]], content_tokens: int
) -> None:
    template = tokens.BOS_TOKENS + tokens.CHAT_GENERATION_PROMPT_TOKENS
    expected = template + tokens.CHAT_TOKENS_PER_MESSAGE * len(messages) + content_tokens
    assert tokens.count_chat_prompt(messages) == expected


def test_fake_text_has_one_word_per_token() -> None:
    text = tokens.fake_text(seed=123, start=0, count=50)
    assert tokens.count_text_tokens(text) == 50
    assert text.startswith(" ")


def test_fake_text_is_deterministic_and_splits_cleanly() -> None:
    whole = tokens.fake_text(seed=7, start=0, count=20)
    parts = tokens.fake_text(7, 0, 5) + tokens.fake_text(7, 5, 10) + tokens.fake_text(7, 15, 5)
    assert whole == parts


def test_stride_visits_every_word() -> None:
    assert math.gcd(tokens._STRIDE, len(tokens._WORDS)) == 1
    words = {tokens.fake_word(0, i) for i in range(len(tokens._WORDS))}
    assert len(words) == len(tokens._WORDS)


def test_text_seed_is_stable() -> None:
    # crc32 is fixed by its definition; Python's hash() would change with PYTHONHASHSEED.
    assert tokens.text_seed("abc") == 891568578


def test_fake_token_ids_one_per_piece_in_vocab() -> None:
    ids = tokens.fake_token_ids("Hello, world!")
    assert len(ids) == 4
    assert all(0 <= i < tokens.VOCAB_SIZE for i in ids)
