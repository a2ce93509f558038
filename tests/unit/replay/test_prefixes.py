"""Shared prefixes in the replay: the Mooncake trace's block ids, and the prompts built from them.

``load_mooncake_trace`` reads each request's ``hash_ids``; ``replay.prefixes`` turns them into
token ids for the emulated engine and text for the gateway, equal exactly as far as the ids are.
"""

from __future__ import annotations

import pytest

from bench.goodput.core import FACTS, PROFILE, TARGETS
from replay import (
    FleetConfig,
    PromptText,
    TraceRequest,
    at_rate,
    gateway_requests,
    piecewise_rate,
    run_gateway_replay,
)
from replay.baselines import PrefixAffinity
from replay.prefixes import (
    HASH_BLOCK_TOKENS,
    TOKEN_ID_LIMIT,
    block_text,
    prompt_text,
    prompt_token_ids,
)
from replay.traces import load_mooncake_trace, parse_hash_ids
from simulator.engine import Engine
from simulator.profile import load_profile

B = HASH_BLOCK_TOKENS


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("0", (0,)),
        ("0 14-17", (0, 14, 15, 16, 17)),
        ("3-3 9 1-2", (3, 9, 1, 2)),
        ("", ()),
    ],
)
def test_hash_id_runs_parse(text: str, ids: tuple[int, ...]) -> None:
    assert parse_hash_ids(text) == ids


def test_a_descending_run_is_refused() -> None:
    with pytest.raises(ValueError, match="descending"):
        parse_hash_ids("5-3")


def test_the_mooncake_trace_carries_its_block_ids() -> None:
    rows = load_mooncake_trace(count=5, spread=False)
    # The file's first rows, as the original JSON lines have them.
    assert rows[0].hash_ids == tuple(range(14))
    assert rows[1].hash_ids == (0, *range(14, 28))
    assert [r.prompt_tokens for r in rows[:2]] == [6758, 7322]
    for r in load_mooncake_trace(count=400):
        assert r.hash_ids is not None
        n = len(r.hash_ids)
        assert B * (n - 1) < r.prompt_tokens <= B * n


def test_retiming_keeps_the_block_ids() -> None:
    rows = load_mooncake_trace(count=50)
    for timed in (at_rate(rows, 20.0), piecewise_rate(rows, [(1.0, 20.0), (1.0, 10.0)])):
        assert timed
        assert all(r.hash_ids is not None for r in timed)
        assert [r.hash_ids for r in timed] == [r.hash_ids for r in rows[: len(timed)]]


def test_token_ids_agree_exactly_as_far_as_the_block_ids() -> None:
    a = prompt_token_ids((0, 1, 2), 2 * B + 100)
    b = prompt_token_ids((0, 1, 7), 3 * B)
    c = prompt_token_ids((5, 1, 2), 2 * B + 100)
    assert len(a) == 2 * B + 100
    assert len(b) == 3 * B
    assert a[: 2 * B] == b[: 2 * B]
    assert a[2 * B] != b[2 * B]
    assert a[:1] != c[:1]  # another first block: nothing shared
    assert all(0 <= t < TOKEN_ID_LIMIT for t in a)
    assert prompt_token_ids((0, 1, 2), 2 * B + 100) == a  # deterministic
    # A partial last block is that block's first tokens.
    assert prompt_token_ids((0, 1), B + 10) == prompt_token_ids((0, 1), 2 * B)[: B + 10]


def test_a_prompt_beyond_its_blocks_ends_in_a_tail_of_its_own() -> None:
    a = prompt_token_ids((0,), B + 50, tail_key="a")
    b = prompt_token_ids((0,), B + 50, tail_key="b")
    assert a[:B] == b[:B]
    assert a[B:] != b[B:]
    assert len(prompt_text((0,), B + 50, tail_key="a")) > len(block_text(0))


def test_text_agrees_exactly_as_far_as_the_block_ids() -> None:
    a = prompt_text((0, 1, 2), 3 * B)
    b = prompt_text((0, 1, 9), 3 * B)
    shared = len(block_text(0)) + len(block_text(1))
    assert a[:shared] == b[:shared]
    assert a[shared:] != b[shared:]
    assert a.isascii()
    # About 4 characters a token, the part of a block in proportion.
    sizes = [len(block_text(h)) / B for h in range(300)]
    assert 3.6 < sorted(sizes)[150] < 4.4
    assert len(prompt_text((3,), B // 2)) == len(block_text(3)) // 2


def test_requests_with_block_ids_are_sized_from_their_text() -> None:
    trace = [TraceRequest(0.0, 700, 5, (0, 1)), TraceRequest(1.0, 300, 5)]
    config = FleetConfig(load_profile(PROFILE), FACTS, text=PromptText())
    with_ids, without = gateway_requests(trace, config)
    text = with_ids.text()
    assert text is not None
    assert with_ids.prompt_chars == len(text)
    assert with_ids.token_ids() == prompt_token_ids((0, 1), 700, tail_key="0")
    assert without.text() is None
    assert without.token_ids() is None
    assert without.prompt_chars == PromptText().chars(1, 300)


def test_the_emulated_engine_hits_where_the_blocks_are_shared() -> None:
    profile = load_profile(PROFILE)
    engine = Engine(profile, seed=0, jitter=0.0)
    trace = [TraceRequest(0.0, 2 * B + 40, 4, (0, 1, 2)), TraceRequest(0.0, 3 * B, 4, (0, 1, 5))]
    requests = gateway_requests(trace, FleetConfig(profile, FACTS))
    now = 0.0
    for r in requests:
        engine.add_request(str(r.index), r.prompt_tokens, 4, 4, now, prompt_token_ids=r.token_ids())
        while engine.has_unfinished_requests:
            plan = engine.schedule(now)
            assert plan is not None
            now += plan.duration_s
            engine.complete(plan, now)
    # The second request found its first two blocks (1024 tokens) cached, no more.
    assert engine.stats.prefix_cache_hits == 2 * B
    assert engine.stats.prefix_cache_queries == 2 * B + 40 + 3 * B


def test_llm_d_scorer_sends_a_shared_prefix_to_its_cache() -> None:
    # Replica queues and KV use equal (both idle at each arrival): the prefix score decides.
    profile = load_profile(PROFILE)
    trace = [
        TraceRequest(0.0, 4 * B, 5, (1, 2, 3, 4)),
        TraceRequest(2.0, 4 * B, 5, (1, 2, 3, 9)),
        TraceRequest(4.0, 4 * B, 5, (1, 2, 3, 4)),
    ]
    config = FleetConfig(profile, FACTS, replicas=4, text=PromptText())
    result = run_gateway_replay(trace, config, PrefixAffinity(seed=1), targets=TARGETS)
    first, second, third = result.outcomes
    assert first.replica == second.replica == third.replica
    # The engine found the shared blocks: three for the second, all but its last token for the third.
    assert first.cached_tokens == 0
    assert second.cached_tokens == 3 * B
    assert third.cached_tokens >= 4 * B - profile.engine.block_size
