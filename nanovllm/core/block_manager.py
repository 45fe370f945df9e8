"""Paged KV-cache bookkeeping: fixed-size blocks, a free list, ref counts and a prefix cache.
Position p of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`.
A full block's hash chains its predecessor's hash with its token ids (a first block's chains its
sequence's LoRA adapter instead: an adapter's KV is its own); hits are confirmed by token ids and
predecessor (and adapter), so a collision costs a miss, never wrong KV. A freed block keeps its hash
and content until the free list hands it out again, so it can be revived."""

from array import array
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from nanovllm.core.sequence import Sequence
from nanovllm.utils import cdiv


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its KV computed
    token_ids: tuple[int, ...] = ()  # the tokens behind `hash`, to confirm hits
    parent_id: int | None = None  # the block before this one when it was hashed
    salt: int = 0  # a first block's: the LoRA adapter its KV was computed under (0: none)


def compute_block_hash(token_ids: tuple[int, ...], parent_hash: int | None) -> int:
    """xxhash64 over (the previous block's hash, this block's token ids)."""
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


def block_table_width(max_model_len: int, block_size: int) -> int:
    """Blocks of the longest sequence a decode step can see, plus the token it decodes."""
    return cdiv(max_model_len + 1, block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks >= 1 and block_size >= 1, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # Ordered: the longest-freed block goes first (LRU eviction); reviving one is O(1).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_cache_hit_blocks = 0  # statistics: full blocks reused from the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def get_cached_blocks(self, seq: Sequence) -> list[int]:
        """Blocks of seq's longest cached prefix; none while it owes prompt logprobs (all rows)."""
        if not self.enable_prefix_caching or seq.needs_prompt_logits:
            return []
        cached: list[int] = []
        parent_hash, parent_id = seq.lora_int_id or None, None
        for i in range(len(seq) // self.block_size):
            token_ids = tuple(seq.block(i))
            h = compute_block_hash(token_ids, parent_hash)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_id != parent_id or block.token_ids != token_ids:
                break  # a hash collision: recompute rather than trust it
            if i == 0 and block.salt != seq.lora_int_id:
                break
            cached.append(block_id)
            parent_hash, parent_id = h, block_id
        return cached

    def can_allocate(self, seq: Sequence, cached_blocks: list[int]) -> bool:
        # Reviving a cached block that nobody holds takes it off the free list too.
        num_revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return seq.num_blocks - len(cached_blocks) + num_revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached_blocks: list[int]) -> None:
        """Give seq a block table covering all its tokens, reusing `cached_blocks`."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        new_blocks = [self._take_free_block() for _ in range(seq.num_blocks - len(cached_blocks))]
        seq.block_table = array("i", cached_blocks + new_blocks)
        # Even a fully cached prompt computes its last token: its logits are needed.
        seq.num_cached_tokens = min(len(cached_blocks) * self.block_size, len(seq) - 1)
        if seq.num_prefix_cached_tokens < 0:  # the first admission's hits, as vLLM reports
            seq.num_prefix_cached_tokens = seq.num_cached_tokens
        self.num_cache_hit_blocks += len(cached_blocks)

    def deallocate(self, seq: Sequence) -> None:
        # In reverse: a sequence's tail is evicted before its head, which prompts more likely share.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = array("i")
        seq.num_cached_tokens = 0

    def append_slot(self, seq: Sequence) -> bool:
        """Give the token at position len(seq) - 1 a slot (a new block when it starts one);
        False, taking nothing, when that needs a block and none is free."""
        if len(seq.block_table) * self.block_size >= seq.num_tokens:
            return True
        if not self.free_block_ids:
            return False
        seq.block_table.append(self._take_free_block())
        return True

    def cache_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Hash seq's blocks that became full when tokens [start, end) got their KV."""
        if not self.enable_prefix_caching:
            return
        for i in range(start // self.block_size, end // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue  # reused from the cache, already hashed
            block.parent_id = seq.block_table[i - 1] if i > 0 else None
            if block.parent_id is None:
                block.salt = seq.lora_int_id
                parent_hash = block.salt or None
            else:
                parent_hash = self.blocks[block.parent_id].hash
            block.token_ids = tuple(seq.block(i))
            block.hash = compute_block_hash(block.token_ids, parent_hash)
            # The first block to reach a hash keeps it; a twin from the same step stays private.
            self.hash_to_block.setdefault(block.hash, block.block_id)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # its cached content is evicted now
        block.hash, block.token_ids, block.parent_id, block.salt = None, (), None, 0
        block.ref_count = 1
        return block_id
