"""A pure-Python stand-in for the model runner, so the scheduler and block manager
can be driven through whole request lifecycles without a model."""
from nanovllm.core import Scheduler, Sequence


class FakeRunner:
    """Returns one token per scheduled sequence and records every batch."""

    def __init__(self, eos_after: dict[int, int] | None = None, eos: int = 0):
        # (seq ids, tokens each, how many are decode rows) per step
        self.batches: list[tuple[list[int], list[int], int]] = []
        self.eos_after = eos_after or {}  # seq_id -> emit EOS once this many tokens exist
        self.eos = eos

    def run(self, seqs: list[Sequence]) -> list[int]:
        num_decode = sum(1 for s in seqs if not s.is_prefill)
        assert all(not s.is_prefill for s in seqs[:num_decode]), "decode rows come first"
        self.batches.append(([s.seq_id for s in seqs], [s.num_scheduled_tokens for s in seqs],
                             num_decode))
        return [self.next_token(s) for s in seqs]

    def next_token(self, seq: Sequence) -> int:
        # Checks the scheduler's arithmetic: the chunk must lie inside the sequence.
        assert 0 < seq.num_scheduled_tokens
        assert seq.num_cached_tokens + seq.num_scheduled_tokens <= len(seq)
        limit = self.eos_after.get(seq.seq_id)
        if limit is not None and len(seq) + 1 >= limit:
            return self.eos
        return 1000 + len(seq)  # deterministic, never the EOS id


def step(scheduler: Scheduler, runner: FakeRunner) -> list[Sequence]:
    seqs = scheduler.schedule()
    finished = scheduler.postprocess(seqs, runner.run(seqs))
    scheduler.check_integrity()
    return finished


def run_until_done(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> int:
    for steps in range(1, max_steps + 1):
        step(scheduler, runner)
        if scheduler.is_finished():
            return steps
    raise AssertionError("requests did not finish")
