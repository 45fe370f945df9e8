"""A pure-Python stand-in for the model runner, so the scheduler and block manager
can be driven through whole request lifecycles without a model.

It models what the paged KV cache holds. A real model's K/V at position p is a function
of tokens 0..p, so the fake writes exactly that, the prefix `tuple(token_ids[:p + 1])`,
into the cache slot of each token it computes (block_table[p // block_size] * block_size
+ p % block_size), and before answering reads every context position of the sequence
back. A slot holding another prefix means the sequence would attend over wrong KV: a
block shared that should not be, a cached block overwritten after it was handed out, a
token the scheduler claims is cached but never computed. That fails the step at once.
"""

from collections.abc import Callable

from invariants import check_scheduler

from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence


def length_plus_1000(context: tuple[int, ...]) -> int:
    """The default next token: 1000 + the context's length (never the EOS id)."""
    return 1000 + len(context)


class FakeRunner:
    """Returns one token per scheduled sequence, a function of the context it read back
    from the cache (`next_token`), and records every batch."""

    def __init__(
        self,
        eos_after: dict[int, int] | None = None,
        eos: int = 0,
        next_token: Callable[[tuple[int, ...]], int] = length_plus_1000,
    ):
        # (seq ids, tokens each, how many are decode rows) per step
        self.batches: list[tuple[list[int], list[int], int]] = []
        self.eos_after = eos_after or {}  # seq_id -> emit EOS once this many tokens exist
        self.eos = eos
        self.next_token = next_token
        self.kv: dict[int, tuple[int, ...]] = {}  # cache slot -> the prefix its KV is of

    def run(self, seqs: list[Sequence]) -> list[int]:
        num_decode = sum(1 for s in seqs if not s.is_prefill)
        assert all(not s.is_prefill for s in seqs[:num_decode]), "decode rows come first"
        self.batches.append(
            ([s.seq_id for s in seqs], [s.num_scheduled_tokens for s in seqs], num_decode)
        )
        for seq in seqs:  # the whole batch writes before any sequence reads, as in a step
            self.write_kv(seq)
        return [self.sample(seq, self.read_context(seq)) for seq in seqs]

    def write_kv(self, seq: Sequence) -> None:
        # Checks the scheduler's arithmetic: the chunk must lie inside the sequence.
        assert 0 < seq.num_scheduled_tokens
        assert seq.num_cached_tokens + seq.num_scheduled_tokens <= len(seq)
        for p in range(seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens):
            self.kv[slot(seq, p)] = tuple(seq.token_ids[: p + 1])

    def read_context(self, seq: Sequence) -> tuple[int, ...]:
        """The tokens the sequence attends over this step, as read back from the cache."""
        end = seq.num_cached_tokens + seq.num_scheduled_tokens
        for p in range(end):
            held = self.kv.get(slot(seq, p))
            assert held == tuple(seq.token_ids[: p + 1]), (
                f"sequence {seq.seq_id} reads position {p} from slot {slot(seq, p)}, which "
                f"holds the KV of {held} instead of its own prefix"
            )
        return self.kv[slot(seq, end - 1)]

    def sample(self, seq: Sequence, context: tuple[int, ...]) -> int:
        limit = self.eos_after.get(seq.seq_id)
        if limit is not None and len(seq) + 1 >= limit:
            return self.eos
        return self.next_token(context)


def slot(seq: Sequence, position: int) -> int:
    return seq.block_table[position // seq.block_size] * seq.block_size + position % seq.block_size


def step(scheduler: Scheduler, runner: FakeRunner) -> list[Sequence]:
    seqs = scheduler.schedule()
    tokens = runner.run(seqs)
    finished = [seq for seq in scheduler.postprocess(seqs, tokens) if seq.is_finished]
    check_scheduler(scheduler)
    return finished


def run_until_done(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> int:
    for steps in range(1, max_steps + 1):
        step(scheduler, runner)
        if scheduler.is_finished():
            return steps
    raise AssertionError("requests did not finish")
