"""The prefix index: chained block hashes of prompt text, matched, inserted, evicted, trimmed."""

from __future__ import annotations

import pytest

from predictor.prefix_index import (
    PrefixIndex,
    PrefixKey,
    blocks_for_tokens,
    expected_hit_tokens,
    prefix_key,
)

SYSTEM = "You are a helpful assistant. " * 40  # 1,160 bytes: four full blocks of 256


def key(text: str, tokens: int = 1000, **kw: object) -> PrefixKey:
    k = prefix_key(text, tokens, **kw)  # type: ignore[arg-type]
    assert k is not None
    return k


def test_prompts_share_the_blocks_of_their_common_prefix_and_no_more() -> None:
    a = key(SYSTEM + "What is the capital of France? " * 20)
    b = key(SYSTEM + "Write a poem about the sea, please. " * 20)
    shared = len(SYSTEM) // 256  # blocks wholly inside the shared system prompt
    assert a.hashes[:shared] == b.hashes[:shared]
    assert a.hashes[shared] != b.hashes[shared]
    # Chained: the same block text after a different prefix is a different block.
    c = key("x" * 256 + SYSTEM)
    assert set(c.hashes).isdisjoint(a.hashes[:shared])


@pytest.mark.parametrize(
    ("text", "kw", "blocks"),
    [
        ("a" * 255, {}, None),
        ("a" * 256, {}, 1),
        ("a" * 1000, {"block_bytes": 100}, 10),
        ("a" * 1000, {"block_bytes": 100, "max_blocks": 3}, 3),
        ("é" * 128, {}, 1),  # 256 bytes of UTF-8
    ],
    ids=["shorter-than-a-block", "one-block", "small-blocks", "capped", "utf8-bytes"],
)
def test_a_prompt_is_cut_in_whole_blocks_of_bytes(text: str, kw: dict[str, int], blocks: int | None) -> None:
    k = prefix_key(text, 100, **kw)  # type: ignore[arg-type]
    assert (None if k is None else len(k.hashes)) == blocks


def test_the_model_seeds_the_chain() -> None:
    assert key(SYSTEM, seed="a").hashes[0] != key(SYSTEM, seed="b").hashes[0]
    assert key(SYSTEM, seed="a").hashes == key(SYSTEM, seed="a").hashes


def test_each_block_stands_for_its_share_of_the_prompt_tokens() -> None:
    k = key("a" * 1024, tokens=256)
    assert k.tokens_per_block == 64.0
    assert k.tokens(3) == 192
    assert blocks_for_tokens(k, 130) == 2


def test_a_match_ends_at_the_first_missing_block() -> None:
    k = key("abcd" * 256)  # four blocks
    index = PrefixIndex(10_000)
    assert index.match(k) == 0
    index.insert(k)
    assert index.match(k) == 4
    index.trim(k, 1)  # the replica has only the first block left
    assert index.match(k) == 1
    assert len(index) == 1


def test_the_least_recently_used_go_first_a_prompts_tail_before_its_head() -> None:
    a = key("a" * 1024, tokens=400)  # four blocks of 100 tokens
    b = key("b" * 1024, tokens=400)
    index = PrefixIndex(600)
    index.insert(a)
    index.insert(b)  # 800 tokens > 600: a's two tail blocks go
    assert (index.match(a), index.match(b)) == (2, 4)
    assert index.tokens == pytest.approx(600)
    index.resize(100)
    assert (index.match(a), index.match(b)) == (0, 1)
    index.clear()
    assert (len(index), index.tokens) == (0, 0.0)


def test_the_expected_hit_is_the_matched_tokens_times_the_delivered_share_below_the_prompt() -> None:
    k = key("a" * 1024, tokens=400)
    index = PrefixIndex(10_000)
    assert expected_hit_tokens(k, index, 400) == 0
    index.insert(k)
    assert expected_hit_tokens(k, index, 400) == 399  # the last token is always computed
    assert expected_hit_tokens(k, index, 1000) == 400
    assert expected_hit_tokens(k, index, 1000, realized=0.5) == 200
    assert expected_hit_tokens(None, index, 1000) == 0
    assert expected_hit_tokens(k, None, 1000) == 0
