"""Decides what runs each step and, after it, which sequences end. One token budget per step
(vLLM v1): every running sequence past its prompt gets its next token, then prompt chunks
fill the rest, the mid-prefill sequence's first:

    step 1: [ d d d d | prompt A, chunk 1 ............ ]      budget = 16 tokens
    step 2: [ d d d d | prompt A, chunk 2 ...| prompt B ]
    step 3: [ d d d d d | B's rest | ... ]                    A decodes from here on

Only the last sequence admitted can be left part-way: at most one, the newest in `running`,
is mid-prefill between steps.
"""

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import FINISHED, RUNNING, WAITING, FinishReason, Sequence
from nanovllm.utils import cdiv


class StopStrings(Protocol):
    """Finds stop strings in a sequence's text (the engine's StopStringChecker: decoding
    needs the tokenizer, which the control plane never imports)."""

    def check(self, seq: Sequence) -> str | None:
        """The completion's text before a stop string its new tokens complete, or None."""

    def discard(self, seq_id: int) -> None:
        """Forget a finished sequence."""


class Admission(Protocol):
    """Whether a waiting sequence may start beside the running ones (LoRA's: while its adapter
    can have a slot, lora/scheduling.py); a refused one waits at the head of the queue."""

    def admits(self, seq: Sequence, running: Iterable[Sequence]) -> bool: ...


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        stop_strings: StopStrings | None = None,
        policy: str = "mixed",
        admission: Admission | None = None,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.stop_strings = stop_strings  # needed only by requests with stop strings
        self.policy = policy  # "mixed" (decode first) or "prefill_first"
        self.admission = admission  # a seam's limit on what may start (LoRA's slots)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0  # statistics

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        """Queue a request that check_fits accepted, its length limit resolved."""
        max_tokens = seq.sampling_params.max_tokens or self.max_model_len  # None: up to the limit
        seq.max_num_tokens = min(seq.num_prompt_tokens + max_tokens, self.max_model_len)
        self.waiting.append(seq)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Refuse a request that could not run even with the whole cache to itself."""
        if num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens is longer than max_model_len="
                f"{self.max_model_len}; shorten it or raise max_model_len"
            )
        # The last sampled token never needs KV; the length is capped at max_model_len.
        max_tokens = max_tokens or self.max_model_len
        final_len = min(
            num_prompt_tokens + max_tokens, max(self.max_model_len, num_prompt_tokens + 1)
        )
        num_blocks = cdiv(final_len - 1, self.block_manager.block_size)
        if num_blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs {num_blocks} KV-cache blocks but the cache has only "
                f"{self.block_manager.num_blocks}; shorten the prompt or max_tokens, or give "
                f"the cache more memory (num_kvcache_blocks / the memory budget)"
            )

    def schedule(self) -> list[Sequence]:
        """This step's sequences, decode rows first; empty when idle."""
        if self.policy == "prefill_first":  # nano-vLLM's: decode only when no prompt work can run
            seqs = self._schedule_prefill(self.max_num_batched_tokens) or self._schedule_decode()
        else:
            preemptions = self.num_preemptions
            seqs = self._schedule_decode()
            # After a preemption nothing new is admitted this step (as vLLM v1): what was
            # just freed would otherwise go to a prompt the next decode step preempts again.
            admit = self.num_preemptions == preemptions
            seqs += self._schedule_prefill(self.max_num_batched_tokens - len(seqs), admit)
        if not seqs and self._stalled():
            raise RuntimeError("scheduler found no runnable sequence although requests are pending")
        return seqs

    def _stalled(self) -> bool:
        """Nothing could be scheduled, yet requests are pending."""
        return bool(self.running or self.waiting)

    def _decodable(self, seq: Sequence) -> bool:
        """A running sequence decodes once past its prompt (not mid-prefill, not just preempted)."""
        return not seq.is_prefill and seq.status is RUNNING

    def _schedule_decode(self) -> list[Sequence]:
        """A token per decoding sequence, oldest first; preempts the newest if no block is free."""
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        batch: list[Sequence] = []
        for seq in list(self.running):
            if len(batch) == limit:
                break
            if not self._decodable(seq):
                continue
            while not self.block_manager.append_slot(seq):
                victim = self.running[-1]  # newer than seq, or seq itself: never in batch
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                seq.num_scheduled_tokens = 1
                batch.append(seq)
        return batch

    def _schedule_prefill(self, budget: int, admit: bool = True) -> list[Sequence]:
        """Prompt chunks within `budget`: the mid-prefill one's, then waiting ones' if `admit`."""
        batch = [self.running[-1]] if self.running and self.running[-1].is_prefill else []
        for seq in batch:  # at most one is mid-prefill, the newest (see the top): no scan
            budget -= self._schedule_chunk(seq, budget)
        batch = [seq for seq in batch if seq.num_scheduled_tokens]
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            parent = seq.parent  # n > 1: wait for the first's prompt KV, to share it as hits
            if (
                parent is not None
                and parent.is_prefill
                and not parent.is_finished
                and self.block_manager.enable_prefix_caching
            ):
                break  # it is ahead in the queue (a preempted one goes back to the front)
            if self.admission is not None and not self.admission.admits(seq, self.running):
                break
            # Look the prefix up first: the budget is spent only on uncached tokens.
            cached_blocks = self.block_manager.get_cached_blocks(seq)
            if not self.block_manager.can_allocate(seq, cached_blocks):
                break
            self.block_manager.allocate(seq, cached_blocks)
            self.waiting.popleft()
            seq.status = RUNNING
            self.running.append(seq)
            budget -= self._schedule_chunk(seq, budget)
            batch.append(seq)
        return batch

    @staticmethod
    def _schedule_chunk(seq: Sequence, budget: int) -> int:
        seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, max(0, budget))
        return seq.num_scheduled_tokens

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it goes back to the front of the queue."""
        self.running.remove(seq)  # the newest: at the end, found at once
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        seq.status = WAITING
        seq.is_prefill = True
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """After a step: its KV bookkeeping, then its sampled tokens (one per sequence) taken by
        the sequences whose chunk reached their end, and who ends decided. Returns the
        sequences that took a token."""
        accepted, any_finished = [], False
        for seq, token_id in zip(seqs, token_ids, strict=True):
            if self.advance(seq):
                any_finished |= self.take_token(seq, token_id)
                accepted.append(seq)
        if any_finished:
            self.drop_finished()
        return accepted

    def advance(self, seq: Sequence) -> bool:
        """A step's KV bookkeeping: its tokens' KV is written, the blocks it filled are hashed.
        True when the step reached the end of the sequence: it yields a token."""
        block_size = self.block_manager.block_size
        start = seq.num_cached_tokens
        seq.num_cached_tokens = end = start + seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        if end // block_size > start // block_size:  # a block filled up
            self.block_manager.cache_blocks(seq, start, end)
        if end < seq.num_tokens:  # a prefill chunk short of the end: no token
            return False
        seq.is_prefill = False
        return True

    def take_token(self, seq: Sequence, token_id: int) -> bool:
        """seq's new token; True if it ends seq (then drop_finished() takes it off `running`)."""
        seq.append_token(token_id)
        if (reason := self._finish_reason(seq, token_id)) is None:
            return False
        self._finish(seq, reason)
        return True

    def drop_finished(self) -> None:
        self.running = deque(seq for seq in self.running if not seq.is_finished)

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Why seq ends with its newest token, if it does: the one place that decides. A stop token,
        then a stop string, outrank length (vLLM's order); neither counts before min_tokens."""
        params = seq.sampling_params
        if token_id in seq.stop_token_ids and seq.num_completion_tokens > params.min_tokens:
            return FinishReason.STOP
        if params.stop:  # fed every step, so the search sees only the newest text
            text = self.stop_strings.check(seq)
            if text is not None and seq.num_completion_tokens > params.min_tokens:
                seq.stop_text = text
                return FinishReason.STOP
        return FinishReason.LENGTH if seq.num_tokens >= seq.max_num_tokens else None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.num_scheduled_tokens = 0
        seq.status = FINISHED
        seq.finish_reason = reason
        self.block_manager.deallocate(seq)
        if seq.sampling_params.stop:
            self.stop_strings.discard(seq.seq_id)

    def abort(self, request_id: int) -> bool:
        """Drop a pending request (its n sequences), freeing their blocks; False if not pending."""
        seqs = [seq for seq in (*self.waiting, *self.running) if seq.request_id == request_id]
        for seq in seqs:  # O(n), but aborting is rare and off the step path
            (self.waiting if seq.status is WAITING else self.running).remove(seq)
            self._finish(seq, FinishReason.ABORT)
        return bool(seqs)

    def abort_all(self) -> None:
        """Drop every pending request (after a failed step)."""
        for seq in [*self.waiting, *self.running]:
            self._finish(seq, FinishReason.ABORT)
        self.waiting.clear()
        self.running.clear()
