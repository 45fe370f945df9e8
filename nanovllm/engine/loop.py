"""Step loops: how the engine turns scheduled batches into tokens. One interface (StepLoop), three
implementations, chosen once when the engine is built (llm_engine.py's select_loop):

    SyncLoop          schedule -> run -> postprocess, a step at a time (here: the default)
    OverlapLoop       step n + 1 scheduled and launched before step n's tokens are read
                      (overlap.py: async_scheduling)
    SpeculativeLoop   decoding rows verify n-gram drafts in the step's one forward
                      (speculative.py: speculative_config)

A loop makes its scheduler from the engine's config and is given it and the model runner; each
step it reports what happened (StepResult), from which the engine makes the outputs."""

from typing import TYPE_CHECKING, NamedTuple, Protocol

from nanovllm.config import Config
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.sampling.sampler import SamplerOutput
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.speculative.metrics import SpecDecodeStats


class TakenToken(NamedTuple):
    seq: Sequence
    token_id: int
    logprobs: dict | None  # its logprob entry, if asked for


class StepResult(NamedTuple):
    accepted: list[Sequence]  # the sequences that took a token this step (each once)
    num_prefill_tokens: int  # prompt tokens computed this step
    num_decode_tokens: int  # decode tokens computed this step
    # Every token taken, in order, where a sequence may take several (speculation); None: one
    # each, the accepted sequences' last.
    taken: list[TakenToken] | None = None
    spec_decode: "SpecDecodeStats | None" = None  # this step's drafts, with speculation


class StepLoop(Protocol):
    scheduler: Scheduler

    @staticmethod
    def make_scheduler(block_manager: BlockManager, config: Config) -> Scheduler:
        """The scheduler this loop drives (the engine keeps it for requests and stats)."""
        ...

    def __init__(self, scheduler: Scheduler, runner: ModelRunner): ...

    def step(self) -> StepResult:
        """One step of every pending request; an idle engine does nothing."""
        ...

    def check(self, params: SamplingParams) -> None:
        """Refuse (ValueError) a request's option this loop cannot honour."""
        ...

    def reset(self) -> None:
        """After a failed step, once every request was dropped: nothing is in flight."""
        ...


class SyncLoop:
    """nano-vLLM's step: schedule, run the batch, and postprocess its tokens before the next."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner):
        self.scheduler, self.runner = scheduler, runner

    @staticmethod
    def make_scheduler(block_manager: BlockManager, config: Config) -> Scheduler:
        return Scheduler(block_manager, **scheduler_limits(config))

    def step(self) -> StepResult:
        return self.run(self.scheduler.schedule())

    def run(self, seqs: list[Sequence]) -> StepResult:
        """A scheduled batch through the model, its tokens postprocessed."""
        if not seqs:
            return StepResult([], 0, 0)
        num_prefill, num_decode = count_tokens(seqs)
        out = self.runner.run(seqs)
        return StepResult(postprocess(self.scheduler, seqs, out), num_prefill, num_decode)

    def check(self, params: SamplingParams) -> None:
        """Every option works a step at a time."""

    def reset(self) -> None:
        """Nothing outlives a step here."""


def scheduler_limits(config: Config) -> dict:
    """The Scheduler's keyword arguments from the engine's config."""
    limits = dict(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        policy=config.scheduling_policy,
    )
    if config.enable_lora:  # a request waits while its adapter can have no slot
        from nanovllm.lora.scheduling import AdapterSlots

        limits["admission"] = AdapterSlots(config.max_loras)
    return limits


def count_tokens(seqs: list[Sequence]) -> tuple[int, int]:
    """(prompt tokens, decode tokens) a scheduled batch computes; decode rows come first."""
    num_decode = next((i for i, seq in enumerate(seqs) if seq.is_prefill), len(seqs))
    return sum(seq.num_scheduled_tokens for seq in seqs[num_decode:]), num_decode


def postprocess(scheduler: Scheduler, seqs: list[Sequence], out: SamplerOutput) -> list[Sequence]:
    """A step's tokens (and logprobs, where asked) into its sequences; the scheduler decides
    which end. The sequences that took a token."""
    record_logprobs(seqs, out)
    return scheduler.postprocess(seqs, out.token_ids)


def record_logprobs(seqs: list[Sequence], out: SamplerOutput) -> None:
    if out.logprobs is not None or out.prompt_logprobs is not None:
        from nanovllm.sampling.logprobs import record_logprobs as record

        record(seqs, out)
