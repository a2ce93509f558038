"""Prefix caching as vLLM V1 does it: chained block hashes, full blocks only, the last token always
computed, LRU eviction of free blocks, counters in tokens. Hand-built prompts, fake clock."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator import cli, tokens
from simulator.engine import Engine, FinishedRequestStats
from simulator.prefix_cache import BlockPool, BlockTable, block_hashes
from simulator.profile import load_profile
from simulator.sglang import SglangMetrics

BLOCK = 4
BASE = load_profile("llama3-8b-h100")


def make_engine(*, num_gpu_blocks: int = 1000, caching: bool = True, budget: int = 256) -> Engine:
    profile = BASE.with_engine(
        max_num_batched_tokens=budget,
        max_num_seqs=16,
        block_size=BLOCK,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=512,
        enable_prefix_caching=caching,
    )
    return Engine(profile, seed=0)


class Clock:
    now = 0.0


def run_one(
    engine: Engine, request_id: str, ids: list[int], *, max_tokens: int = 2, clock: Clock | None = None
) -> FinishedRequestStats:
    """Add one request and step the engine until it finishes; returns its stats."""
    clock = clock or Clock()
    engine.add_request(request_id, len(ids), max_tokens, max_tokens, clock.now, prompt_token_ids=ids)
    while True:
        plan = engine.schedule(clock.now)
        assert plan is not None
        clock.now += 0.01
        result = engine.complete(plan, clock.now)
        for finished in result.finished:
            if finished.request_id == request_id:
                return finished


def prompt(base: int, length: int) -> list[int]:
    return list(range(base, base + length))


def test_block_hashes_are_chained_and_cover_full_blocks_only() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    assert len(a) == 2  # the 9th token is a partial block: no hash
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    # Same second block, different first: the chain makes the second hash differ too.
    assert a[1] != b[1]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BLOCK) == a


@pytest.mark.parametrize("shared_blocks", [1, 2, 5])
def test_two_requests_sharing_n_full_blocks_hit_n_blocks(shared_blocks: int) -> None:
    engine = make_engine()
    shared = prompt(1000, shared_blocks * BLOCK)
    first = run_one(engine, "a", [*shared, *prompt(1, 7)])
    second = run_one(engine, "b", [*shared, *prompt(50, 7)])
    assert first.cached_tokens == 0
    assert second.cached_tokens == shared_blocks * BLOCK
    assert engine.stats.prefix_cache_hits == shared_blocks * BLOCK


def test_a_partial_block_never_hits() -> None:
    engine = make_engine()
    run_one(engine, "a", prompt(1, 2 * BLOCK + 3))
    # Shares 2 full blocks and 3 tokens of the third: only the full blocks hit.
    second = run_one(engine, "b", [*prompt(1, 2 * BLOCK + 3), 999, 998])
    assert second.cached_tokens == 2 * BLOCK


def test_the_last_prompt_token_is_never_a_hit() -> None:
    engine = make_engine()
    ids = prompt(1, 3 * BLOCK)  # exactly 3 full blocks
    run_one(engine, "a", ids)
    again = run_one(engine, "b", ids)
    # All 3 blocks are cached, but the last token must be computed: the last block is recomputed.
    assert again.cached_tokens == 2 * BLOCK
    one_more = run_one(engine, "c", [*ids, 7])
    assert one_more.cached_tokens == 3 * BLOCK


def test_a_hit_skips_prefill_compute() -> None:
    engine = make_engine()
    ids = prompt(1, 40 * BLOCK + 1)
    engine.add_request("a", len(ids), 1, 1, 0.0, prompt_token_ids=ids)
    cold = engine.schedule(0.0)
    assert cold is not None
    engine.complete(cold, cold.duration_s)
    engine.add_request("b", len(ids), 1, 1, 1.0, prompt_token_ids=ids)
    warm = engine.schedule(1.0)
    assert warm is not None
    assert warm.num_scheduled_tokens == {"b": 1}  # only the last token is computed
    assert warm.num_prefill_tokens == 1
    assert warm.duration_s < cold.duration_s


def test_counters_add_up_in_tokens() -> None:
    engine = make_engine()
    prompts = [prompt(1, 10), prompt(1, 13), prompt(500, 9), prompt(1, 10)]
    stats = [run_one(engine, f"r{i}", ids) for i, ids in enumerate(prompts)]
    assert engine.stats.prefix_cache_queries == sum(map(len, prompts)) == engine.stats.prompt_tokens
    assert [s.cached_tokens for s in stats] == [0, 2 * BLOCK, 0, 2 * BLOCK]
    assert engine.stats.prefix_cache_hits == sum(s.cached_tokens for s in stats)
    # The tokens each prefill wrote into the cache: its full blocks not already there.
    assert [s.created_cache_tokens for s in stats] == [2 * BLOCK, BLOCK, 2 * BLOCK, 0]


def test_caching_off_counts_nothing_and_never_hits() -> None:
    engine = make_engine(caching=False)
    ids = prompt(1, 20)
    run_one(engine, "a", ids)
    again = run_one(engine, "b", ids)
    assert again.cached_tokens == 0
    assert (engine.stats.prefix_cache_queries, engine.stats.prefix_cache_hits) == (0, 0)


def test_requests_without_token_ids_neither_hit_nor_fill_the_cache() -> None:
    engine = make_engine()
    clock = Clock()
    engine.add_request("a", 20, 2, 2, 0.0)
    while engine.has_unfinished_requests:
        plan = engine.schedule(clock.now)
        assert plan is not None
        clock.now += 0.01
        engine.complete(plan, clock.now)
    assert engine.prefix_cache.num_cached_blocks == 0
    assert engine.stats.prefix_cache_queries == 20  # looked up, as vLLM counts every admission


def test_output_blocks_are_cached_for_the_next_turn() -> None:
    engine = make_engine()
    ids = prompt(1, 6)
    outputs = [900 + i for i in range(10)]
    engine.add_request(
        "turn1", len(ids), 10, 10, 0.0, prompt_token_ids=ids, output_token_id=lambda i: outputs[i]
    )
    clock = Clock()
    while engine.has_unfinished_requests:
        plan = engine.schedule(clock.now)
        assert plan is not None
        clock.now += 0.01
        engine.complete(plan, clock.now)
    # Turn 2: the history (prompt + answer) and a new message. The answer's last token was
    # sampled, never fed back, so the cache holds up to the block before it.
    history = [*ids, *outputs]  # 16 tokens: 4 blocks, the last ending with the unfed token
    second = run_one(engine, "turn2", [*history, 77, 78], clock=clock)
    assert second.cached_tokens == 3 * BLOCK


def test_free_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(6, BLOCK, enable_caching=True)
    tables = {}
    for name, base in (("old", 100), ("new", 200)):
        ids = prompt(base, 2 * BLOCK)
        table = BlockTable()
        assert pool.allocate(table, len(ids))
        pool.cache_blocks(table, block_hashes(ids, BLOCK), len(ids))
        tables[name] = (table, block_hashes(ids, BLOCK))
    pool.free(tables["old"][0])
    pool.free(tables["new"][0])
    assert (pool.num_free, pool.num_cached_blocks) == (6, 4)
    # 2 uncached free blocks come first, then "old"'s blocks tail first, then "new"'s.
    taker = BlockTable()
    assert pool.allocate(taker, 3 * BLOCK)  # 2 uncached + old's tail block
    old, new = tables["old"][1], tables["new"][1]
    assert [pool.is_cached(h) for h in old] == [True, False]
    assert pool.find_hit(old, 100) == [old[0]]
    assert pool.allocate(taker, 4 * BLOCK)  # old's head block goes next
    assert pool.find_hit(old, 100) == []
    assert pool.find_hit(new, 100) == new
    assert pool.num_evicted == 2


def test_a_hit_on_a_free_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(4, BLOCK, enable_caching=True)
    ids = prompt(1, 2 * BLOCK)
    hashes = block_hashes(ids, BLOCK)
    table = BlockTable()
    assert pool.allocate(table, len(ids))
    pool.cache_blocks(table, hashes, len(ids))
    pool.free(table)
    assert pool.num_free == 4
    reader = BlockTable()
    hit = pool.find_hit(hashes, len(ids) + 1)
    assert pool.allocate(reader, len(ids) + 1, hit)
    # The 2 hit blocks and 1 new block are held; the hit blocks are not evicted by the new one.
    assert (pool.num_free, pool.num_evicted) == (1, 0)
    # A second reader shares the held blocks: no free block is needed for them.
    other = BlockTable()
    assert pool.allocate(other, len(ids) + 1, pool.find_hit(hashes, len(ids) + 1))
    assert pool.num_free == 0
    assert not pool.allocate(BlockTable(), 1)


def test_an_allocation_that_does_not_fit_takes_nothing() -> None:
    pool = BlockPool(3, BLOCK, enable_caching=True)
    table = BlockTable()
    assert not pool.allocate(table, 4 * BLOCK)
    assert (len(table), pool.num_free) == (0, 3)


def test_kv_usage_counts_cached_free_blocks_as_free() -> None:
    engine = make_engine(num_gpu_blocks=100)
    run_one(engine, "a", prompt(1, 5 * BLOCK))
    assert engine.kv_cache_usage == 0.0
    assert engine.prefix_cache.num_free_cached_blocks == 5


def test_chat_ids_of_the_next_turn_start_with_the_last_turn_and_its_answer() -> None:
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    seed, n = 7, 5
    ids1 = tokens.chat_prompt_ids(turn1)
    assert len(ids1) == tokens.count_chat_prompt(turn1)
    answer = tokens.fake_text(seed, 0, n)
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
    ids2 = tokens.chat_prompt_ids(turn2)
    assert len(ids2) == tokens.count_chat_prompt(turn2)
    history = ids1 + [tokens.fake_word_id(seed, i) for i in range(n)]
    assert ids2[: len(history)] == history


@pytest.mark.parametrize("prompt_value", ["Hello, world!", [5, 6, 7]])
def test_completion_ids_are_one_per_counted_token(prompt_value: str | list[int]) -> None:
    assert len(tokens.completion_prompt_ids(prompt_value)) == tokens.count_completion_prompt(prompt_value)


def test_sglang_cache_hit_rate_is_hit_tokens_over_prompt_tokens() -> None:
    engine = make_engine()
    metrics = SglangMetrics(engine=engine, model_name="m", kv_capacity_tokens=4000)
    clock = Clock()
    for name in ("a", "b"):
        engine.add_request(name, 13, 2, 2, clock.now, prompt_token_ids=prompt(1, 13))
        while engine.has_unfinished_requests:
            plan = engine.schedule(clock.now)
            assert plan is not None
            clock.now += 0.01
            metrics.record_step(engine.complete(plan, clock.now), plan)
    rate = next(
        s.value
        for f in text_string_to_metric_families(metrics.exposition().decode())
        for s in f.samples
        if s.name == "sglang:cache_hit_rate"
    )
    assert rate == pytest.approx(3 * BLOCK / 26)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], None), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False)],
)
def test_cli_prefix_caching_flag_overrides_the_profile(argv: list[str], expected: bool | None) -> None:
    args = cli._parser().parse_args(["--profile", "llama3-8b-h100", *argv])
    assert args.enable_prefix_caching is expected
    assert args.enable_prompt_tokens_details is False
