"""The overlapped step loop of async scheduling (`async_scheduling=True`, vLLM's name): step n + 1
is scheduled, its inputs built and its forward queued on the device while step n still runs,
and only then are step n's tokens read.

    host    | schedule n+1 | inputs n+1 | queue n+1 | read n | advance n+1 | schedule n+2 | ...
    device  | ........ step n ........ | .................. step n+1 ................. | ...

A step's results are recorded in two halves for this, by the loop's own scheduler
(OverlapScheduler): advance() when it is queued (each sequence that will get a token holds a
PENDING last token) and accept() when its tokens are read. Step n + 1's decode rows take the
token step n is still sampling on the device (the runner's `feed`: no host round trip). A
sequence that step n finishes has already been queued in n + 1: that one extra token is computed
and dropped, so the outputs are the synchronous engine's. One rank only (Config refuses
tensor_parallel_size > 1 with it)."""

from typing import NamedTuple

import torch

from nanovllm.config import Config
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import FINISHED, WAITING, FinishReason, Sequence
from nanovllm.engine.loop import StepResult, count_tokens, record_logprobs, scheduler_limits
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.sampling.sampler import SamplerOutput
from nanovllm.sampling_params import SamplingParams

PENDING = -1  # a sampled token not read yet: a sequence's last, from advance() until accept()


class OverlapScheduler(Scheduler):
    """The scheduler with a step in flight: its tokens are PENDING until read, and the next
    step is scheduled meanwhile."""

    def advance_launched(self, seqs: list[Sequence]) -> None:
        """A launched step's bookkeeping, before its tokens are read: a sequence that reached
        its end holds a PENDING token until accept()."""
        for seq in seqs:
            if seq.status is FINISHED:
                continue  # ended while this step was being scheduled
            if self.advance(seq):
                seq.append_token(PENDING)

    def accept(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """A step's sampled tokens in place of its PENDING ones; the sequences that took one.
        One that ended meanwhile (finished or aborted one step earlier) drops its token."""
        accepted, any_finished = [], False
        for seq, token_id in zip(seqs, token_ids, strict=True):
            if seq.last_token != PENDING or seq.status is FINISHED:
                continue
            seq.token_ids[-1] = seq.last_token = token_id
            accepted.append(seq)
            if (reason := self._finish_reason(seq, token_id)) is not None:
                if seq.status is WAITING:  # preempted while its token was computed
                    self.waiting.remove(seq)
                self._finish(seq, reason)
                any_finished = True
        if any_finished:
            self.drop_finished()
        return accepted

    def _decodable(self, seq: Sequence) -> bool:
        """Not one whose token still being computed is its last."""
        last = seq.last_token == PENDING and seq.num_tokens >= seq.max_num_tokens
        return super()._decodable(seq) and not last

    def _stalled(self) -> bool:
        """Not while some sequence waits for a token in flight."""
        pending = (*self.running, *self.waiting)
        return super()._stalled() and not any(seq.last_token == PENDING for seq in pending)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.last_token == PENDING:  # aborted before its token was read
            seq.token_ids.pop()
            seq.num_tokens -= 1
            seq.last_token = seq.token_ids[-1]
        super()._finish(seq, reason)


class InFlight(NamedTuple):
    """A step queued on the device whose tokens are not read yet."""

    seqs: list[Sequence]
    out: SamplerOutput  # its token ids still on the device
    rows: dict[int, int]  # seq_id -> its row in the step


class OverlapLoop:
    def __init__(self, scheduler: OverlapScheduler, runner: ModelRunner):
        self.scheduler, self.runner = scheduler, runner
        self.in_flight: InFlight | None = None

    @staticmethod
    def make_scheduler(block_manager: BlockManager, config: Config) -> OverlapScheduler:
        return OverlapScheduler(block_manager, **scheduler_limits(config))

    def step(self) -> StepResult:
        """Queue step n + 1, then read step n's tokens (which this step reports)."""
        scheduler = self.scheduler
        seqs = scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        accepted = []
        # Penalties count a batch's tokens on the host, and a grammar's matcher must see its
        # sequence's last token before it masks the next: the step in flight is read first,
        # and what its tokens ended (their blocks freed) leaves this step's batch.
        if previous is not None and (not seqs or any(needs_last_token(s) for s in seqs)):
            accepted, previous = self.read(previous), None
            seqs = [seq for seq in seqs if not seq.is_finished]
        num_prefill, num_decode = count_tokens(seqs)
        if seqs:
            out = self.runner.execute_model(seqs, self.feed(seqs, previous))
        if previous is not None:
            accepted = self.read(previous)  # while n + 1 runs
        scheduler.advance_launched(seqs)
        if seqs and not scheduler.is_finished():  # finished: all its tokens are dropped
            self.in_flight = InFlight(seqs, out, {seq.seq_id: i for i, seq in enumerate(seqs)})
        return StepResult(accepted, num_prefill, num_decode)

    def read(self, step: InFlight) -> list[Sequence]:
        """A step's tokens (the host waits for them) into its sequences; those that took one."""
        out = step.out._replace(token_ids=step.out.token_ids.tolist())
        record_logprobs(step.seqs, out)
        return self.scheduler.accept(step.seqs, out.token_ids)

    @staticmethod
    def feed(
        seqs: list[Sequence], previous: InFlight | None
    ) -> tuple[torch.Tensor, list[tuple[int, int]]] | None:
        """The rows whose input token is the step in flight's, paired with its row there."""
        if previous is None:
            return None
        pairs = [
            (row, previous.rows[seq.seq_id])
            for row, seq in enumerate(seqs)
            if seq.last_token == PENDING
        ]
        return (previous.out.token_ids, pairs) if pairs else None

    def check(self, params: SamplingParams) -> None:
        """Every option works overlapped."""

    def reset(self) -> None:
        """After a failed step: nothing is in flight any more."""
        self.in_flight = None


def needs_last_token(seq: Sequence) -> bool:
    """Its sampling reads its last token on the host (penalties, a grammar)."""
    params = seq.sampling_params
    return params.has_penalties or params.structured_outputs is not None
