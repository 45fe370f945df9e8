"""The scheduler with drafts: a decoding row with d drafts computes 1 + d tokens against the
step's budget, with slots for all of them, and after the step keeps what was accepted.

    before:   tokens [ ... t | d1 d2 d3 ]      t has no KV yet; d1..d3 proposed
              KV     [ ... ]                    num_cached_tokens = t's position
    verify:   t d1 d2 d3 computed over the paged cache in one forward -> logits at each
              sampled s0 s1 s2 s3:  s0 == d1, s1 == d2, s2 != d3  -> a = 2 accepted
    after:    tokens [ ... t d1 d2 s2 ]         s2: the corrected (or bonus) token
              KV     [ ... t d1 d2 ]            num_cached_tokens = len - 1 again; d3's KV
                                                rolled back: blocks past it freed, only
                                                blocks whole in accepted KV hashed

The drafts sit in the sequence's token ids (num_scheduled_tokens = 1 + d) from schedule() until
verify(), which rolls them back and feeds the taken tokens one at a time to take_token(), so stop
tokens, stop strings, min_tokens and the length limit decide as without speculation (a stop
inside the accepted drafts ends the sequence there)."""

from typing import NamedTuple

from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import FinishReason, Sequence
from nanovllm.speculative.ngram import NgramProposer
from nanovllm.utils import cdiv

# A row whose drafts all failed proposes again after 2, 4, 8, ... steps, at most this many.
MAX_BACKOFF_STEPS = 64


class Verified(NamedTuple):
    taken: list[int]  # the tokens the sequence took: accepted drafts, then the target's own
    num_accepted: int  # drafts equal to the target's tokens, up to the first that is not


class SpeculativeScheduler(Scheduler):
    def __init__(self, block_manager, *, proposer: NgramProposer, **kwargs):
        super().__init__(block_manager, **kwargs)
        self.proposer = proposer
        self.drafts: dict[int, list[int]] = {}  # seq_id -> this step's drafts, in its tokens
        self.num_draft_tokens = 0  # this step's, reserved from the prefill budget
        self.num_steps = 0  # schedule() calls: the back-off's clock
        # seq_id -> (its verifications in a row that accepted nothing, the step it proposes again)
        self.backoff: dict[int, tuple[int, int]] = {}

    def schedule(self) -> list[Sequence]:
        self.drafts.clear()
        self.num_draft_tokens = 0
        self.num_steps += 1
        return super().schedule()

    def _schedule_decode(self) -> list[Sequence]:
        """Every decoding sequence's next token (preempting as without drafts), then drafts for
        them, oldest first, within the budget the decode rows leave."""
        batch = super()._schedule_decode()
        spare = self.max_num_batched_tokens - len(batch)
        for seq in batch:
            # Drafts never run past the length limit: 1 + d tokens fit in max_num_tokens.
            limit = min(spare, seq.max_num_tokens - seq.num_tokens - 1)
            if limit <= 0 or self.backoff.get(seq.seq_id, (0, 0))[1] > self.num_steps:
                continue
            drafts = self._reserve_slots(seq, self.proposer.propose(seq, limit))
            if drafts:
                self.drafts[seq.seq_id] = drafts
                seq.num_scheduled_tokens = 1 + len(drafts)
                spare -= len(drafts)
        self.num_draft_tokens = sum(map(len, self.drafts.values()))
        return batch

    def _schedule_prefill(self, budget: int, admit: bool = True) -> list[Sequence]:
        return super()._schedule_prefill(budget - self.num_draft_tokens, admit)

    def _reserve_slots(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """Append the drafts to seq's tokens with slots for their KV; as many as free blocks
        allow (a draft never preempts anyone)."""
        if not drafts:
            return drafts
        num_tokens = seq.num_tokens
        seq.token_ids += drafts
        seq.num_tokens += len(drafts)
        block_manager = self.block_manager
        while len(seq.block_table) * block_manager.block_size < seq.num_tokens:
            if not block_manager.append_slot(seq):  # adds one block, or none is free
                break
        kept = min(len(drafts), len(seq.block_table) * block_manager.block_size - num_tokens)
        del seq.token_ids[num_tokens + kept :]
        seq.num_tokens = num_tokens + kept
        return drafts[:kept]

    def verify(self, seq: Sequence, sampled: list[int]) -> "Verified":
        """After the step: `sampled` [1 + d] are the target's tokens at each of seq's rows.
        Keeps the drafts up to the first that differs from its sampled token, rolls back the
        rest, and takes the sampled tokens through that one, one at a time (fewer when one
        ends the sequence)."""
        drafts = self.drafts[seq.seq_id]
        num_accepted = num_accepted_drafts(drafts, sampled)
        self._back_off(seq.seq_id, num_accepted)
        num_tokens = seq.num_tokens - len(drafts)  # without the drafts
        start, end = seq.num_cached_tokens, num_tokens + num_accepted  # KV now valid up to end
        seq.num_scheduled_tokens, seq.num_cached_tokens = 0, end
        block_size = self.block_manager.block_size
        if end // block_size > start // block_size:  # drafts still in the tokens: hashed right
            self.block_manager.cache_blocks(seq, start, end)
        self._free_blocks_after(seq, cdiv(end, block_size))
        del seq.token_ids[num_tokens:]
        seq.num_tokens = num_tokens
        taken = []
        for token_id in sampled[: num_accepted + 1]:
            taken.append(token_id)
            if self.take_token(seq, token_id):
                self.drop_finished()
                break
        return Verified(taken, num_accepted)

    def _back_off(self, seq_id: int, num_accepted: int) -> None:
        """After a verification that accepted nothing the row skips drafts for 2 steps, then
        4, 8, ... (up to MAX_BACKOFF_STEPS) while they keep failing; one accepted draft ends
        it. Where drafts never hit, verifying k wasted tokens every step would cost every step
        (docs/speculative.md); backed off, only one step in many does."""
        if num_accepted:
            self.backoff.pop(seq_id, None)
            return
        misses = self.backoff.get(seq_id, (0, 0))[0] + 1
        self.backoff[seq_id] = misses, self.num_steps + min(2**misses, MAX_BACKOFF_STEPS)

    def _free_blocks_after(self, seq: Sequence, num_blocks: int) -> None:
        """Give back seq's blocks past the first num_blocks: taken for rejected drafts in this
        step (never hashed, never shared), they go to the front of the free list, as nothing
        cached is lost by reusing them first."""
        block_manager = self.block_manager
        while len(seq.block_table) > num_blocks:
            block = block_manager.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None, block
            block_manager.free_block_ids[block.block_id] = None
            block_manager.free_block_ids.move_to_end(block.block_id, last=False)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        super()._finish(seq, reason)
        self.proposer.forget(seq.seq_id)
        self.backoff.pop(seq.seq_id, None)


def num_accepted_drafts(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts equal the target's token at their position, up to the first that does
    not. Sampled, this is rejection sampling for a point-mass draft (engine/speculative.py)."""
    return next((i for i, draft in enumerate(drafts) if sampled[i] != draft), len(drafts))
