"""The overlapped step loop of async scheduling (`async_scheduling=True`, vLLM's name): step n + 1
is scheduled, its inputs built and its forward queued on the device while step n still runs,
and only then are step n's tokens read.

    host    | schedule n+1 | inputs n+1 | queue n+1 | read n | advance n+1 | schedule n+2 | ...
    device  | ........ step n ........ | .................. step n+1 ................. | ...

A step's results are recorded in two halves for this: Scheduler.advance() when it is queued
(each sequence that will get a token holds a PENDING last token) and accept() when its tokens
are read. Step n + 1's decode rows take the token step n is still sampling on the device (the
runner's `feed`: no host round trip). A sequence that step n finishes has already been queued
in n + 1: that one extra token is computed and dropped, so the outputs are the synchronous
engine's. One rank only (Config refuses tensor_parallel_size > 1 with it)."""

from typing import TYPE_CHECKING, NamedTuple

import torch

from nanovllm.core.sequence import PENDING, Sequence
from nanovllm.sampling.sampler import SamplerOutput
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.engine.llm_engine import LLMEngine, StepOutput


class InFlight(NamedTuple):
    """A step queued on the device whose tokens are not read yet."""

    seqs: list[Sequence]
    out: SamplerOutput  # its token ids still on the device
    rows: dict[int, int]  # seq_id -> its row in the step


class OverlapLoop:
    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        self.in_flight: InFlight | None = None

    def step(self) -> "StepOutput":
        """Queue step n + 1, then read step n's tokens (which this step reports)."""
        engine, scheduler = self.engine, self.engine.scheduler
        seqs = scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        accepted = []
        # Penalties count a batch's tokens on the host, and a grammar's matcher must see its
        # sequence's last token before it masks the next: the step in flight is read first,
        # and what its tokens ended (their blocks freed) leaves this step's batch.
        if previous is not None and (not seqs or any(needs_last_token(s) for s in seqs)):
            accepted, previous = engine.postprocess(previous.seqs, previous.out), None
            seqs = [seq for seq in seqs if not seq.is_finished]
        num_prefill, num_decode = engine.count_tokens(seqs)
        if seqs:
            out = engine.model_runner.execute_model(seqs, self.feed(seqs, previous))
        if previous is not None:
            accepted = engine.postprocess(previous.seqs, previous.out)  # while n + 1 runs
        scheduler.advance(seqs)
        if seqs and not scheduler.is_finished():  # finished: all its tokens are dropped
            self.in_flight = InFlight(seqs, out, {seq.seq_id: i for i, seq in enumerate(seqs)})
        return engine.step_output(accepted, num_prefill, num_decode)

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

    def reset(self) -> None:
        """After a failed step: nothing is in flight any more."""
        self.in_flight = None

    @staticmethod
    def check(params: SamplingParams) -> None:
        """Every request's options work overlapped (make_request asks each loop)."""

    @staticmethod
    def spec_decode_stats() -> None:
        """No drafts here (EngineStats.spec_decode)."""


def needs_last_token(seq: Sequence) -> bool:
    """Its sampling reads its last token on the host (penalties, a grammar)."""
    params = seq.sampling_params
    return params.has_penalties or params.structured_outputs is not None
