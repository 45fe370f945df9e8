"""BlockManager: allocation, ref counts, and the prefix cache."""

import pytest
from invariants import check_blocks

from nanovllm.core import block_manager as bm_module
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BS = 4


def seq(tokens: list[int], max_tokens: int = 8) -> Sequence:
    return Sequence(tokens, SamplingParams(max_tokens=max_tokens), block_size=BS)


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    cached = bm.get_cached_blocks(s)
    assert bm.can_allocate(s, cached)
    bm.allocate(s, cached)
    return cached


def compute(bm: BlockManager, s: Sequence) -> None:
    """What a step does to the bookkeeping: the scheduled tokens get their KV."""
    start = s.num_cached_tokens
    s.num_cached_tokens = len(s)
    bm.cache_blocks(s, start, len(s))


def test_allocate_gives_enough_distinct_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = seq(list(range(10))), seq(list(range(100, 105)))
    admit(bm, a)
    admit(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_free_blocks == 3
    assert all(bm.blocks[i].ref_count == 1 for i in a.block_table + b.block_table)
    check_blocks(bm, [a, b])
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 8 and not a.block_table and a.num_cached_tokens == 0
    check_blocks(bm, [])


def test_can_allocate_counts_free_blocks():
    bm = BlockManager(num_blocks=3, block_size=BS)
    big = seq(list(range(13)))  # 4 blocks
    assert not bm.can_allocate(big, bm.get_cached_blocks(big))
    ok = seq(list(range(12)))  # exactly 3 blocks
    assert bm.can_allocate(ok, [])


def test_shared_prefix_shares_physical_blocks_with_ref_count_two():
    bm = BlockManager(num_blocks=10, block_size=BS)
    prefix = list(range(1, 9))  # two full blocks
    a = seq(prefix + [50, 51])
    admit(bm, a)
    compute(bm, a)
    b = seq(prefix + [60])
    cached = admit(bm, b)
    assert cached == a.block_table[:2].tolist()
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [2, 2]
    assert b.num_cached_tokens == 8
    assert bm.num_cache_hit_blocks == 2
    check_blocks(bm, [a, b])


def test_prefix_must_match_from_the_first_block():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    compute(bm, a)
    # Same second block, different first block: the hash chain differs, no hit.
    b = seq([9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert bm.get_cached_blocks(b) == []


def test_blocks_are_hashed_only_once_their_kv_is_computed():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = seq(list(range(1, 9)))
    admit(bm, a)
    assert all(bm.blocks[i].hash is None for i in a.block_table)
    assert bm.get_cached_blocks(seq(list(range(1, 9)))) == []
    compute(bm, a)
    assert all(bm.blocks[i].hash is not None for i in a.block_table)


def test_partial_block_is_never_hashed():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = seq(list(range(1, 7)))  # one full block + 2 tokens
    admit(bm, a)
    compute(bm, a)
    assert bm.blocks[a.block_table[0]].hash is not None
    assert bm.blocks[a.block_table[1]].hash is None


def test_forced_hash_collision_is_not_a_false_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "compute_block_hash", lambda token_ids, parent: 42)
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    compute(bm, a)
    # Every block hashes to 42. Different tokens must miss...
    assert bm.get_cached_blocks(seq([7, 7, 7, 7, 1])) == []
    # ...and equal tokens at another position (another prefix) must miss too.
    b = seq([1, 2, 3, 4, 1, 2, 3, 4, 9])
    assert bm.get_cached_blocks(b) == [a.block_table[0]]


def test_freed_cached_block_is_revived_with_its_hash():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a)
    first = a.block_table[0]
    h = bm.blocks[first].hash
    bm.deallocate(a)
    assert bm.blocks[first].ref_count == 0 and bm.blocks[first].hash == h
    b = seq([1, 2, 3, 4, 6, 7])
    assert admit(bm, b) == [first]
    assert bm.blocks[first].hash == h and bm.blocks[first].ref_count == 1
    assert first not in bm.free_block_ids
    assert bm.hash_to_block[h] == first
    check_blocks(bm, [b])


def test_reusing_a_freed_block_evicts_its_cache_entry():
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a)
    bm.deallocate(a)
    c = seq([9, 9, 9, 9, 9, 9])  # needs both blocks: the cached one is evicted
    admit(bm, c)
    assert bm.hash_to_block == {}
    assert bm.get_cached_blocks(seq([1, 2, 3, 4, 5])) == []
    check_blocks(bm, [c])


def test_free_list_hands_out_longest_freed_blocks_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8])
    admit(bm, a)
    compute(bm, a)
    head, tail = a.block_table
    bm.deallocate(a)
    # The two never-used blocks go first, then a's tail; its head survives longest.
    admit(bm, seq(list(range(20, 32))))
    assert bm.blocks[tail].hash is None
    assert bm.get_cached_blocks(seq([1, 2, 3, 4, 5, 6, 7, 8, 0])) == [head]


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=10, block_size=BS)
    prompt = list(range(1, 9))  # exactly two full blocks
    a = seq(prompt)
    admit(bm, a)
    compute(bm, a)
    b = seq(prompt)
    cached = admit(bm, b)
    assert len(cached) == 2 and len(b.block_table) == 2
    assert b.num_cached_tokens == len(prompt) - 1


def test_decode_appends_a_block_exactly_when_a_token_starts_one():
    bm = BlockManager(num_blocks=3, block_size=BS)
    s = seq([1, 2, 3, 4])
    admit(bm, s)
    compute(bm, s)
    s.append_token(5)  # position 4 opens block 2
    assert bm.append_slot(s)
    assert len(s.block_table) == 2
    compute(bm, s)
    s.append_token(6)  # position 5 fits in block 2
    assert bm.append_slot(s)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 1
    check_blocks(bm, [s])


def test_append_slot_is_false_without_a_free_block_and_takes_nothing():
    bm = BlockManager(num_blocks=1, block_size=BS)
    s = seq([1, 2, 3, 4])
    admit(bm, s)
    s.append_token(5)
    assert not bm.append_slot(s)
    assert len(s.block_table) == 1
    check_blocks(bm, [s])


def test_check_blocks_catches_a_wrong_ref_count():
    bm = BlockManager(num_blocks=4, block_size=BS)
    s = seq([1, 2])
    admit(bm, s)
    bm.blocks[s.block_table[0]].ref_count = 2
    with pytest.raises(AssertionError):
        check_blocks(bm, [s])


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    a = seq(list(range(1, 9)))
    admit(bm, a)
    compute(bm, a)
    assert bm.get_cached_blocks(seq(list(range(1, 9)))) == []
    assert bm.hash_to_block == {}
