"""The control plane's invariants, asserted by tests after every step they drive."""

from collections.abc import Iterable

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence


def check_blocks(bm: BlockManager, seqs: Iterable[Sequence]) -> None:
    """Assert the invariants, given every sequence that holds blocks."""
    refs = [0] * bm.num_blocks
    for seq in seqs:
        # Every token but a just-sampled last one has (or is getting) a slot.
        assert len(seq.block_table) * bm.block_size >= len(seq) - 1, seq.seq_id
        for i, block_id in enumerate(seq.block_table):
            refs[block_id] += 1
            block = bm.blocks[block_id]
            assert block.hash is None or block.token_ids == tuple(seq.block(i)), block_id
    for block in bm.blocks:
        assert (block.block_id in bm.free_block_ids) != (block.ref_count > 0), block
        assert block.ref_count == refs[block.block_id], (block, refs[block.block_id])
    for h, block_id in bm.hash_to_block.items():
        block = bm.blocks[block_id]
        assert block.hash == h and len(block.token_ids) == bm.block_size, block


def check_scheduler(scheduler: Scheduler) -> None:
    check_blocks(scheduler.block_manager, scheduler.running)
