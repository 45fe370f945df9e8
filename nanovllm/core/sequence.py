"""One request (one of its n completions) as the control plane sees it:

    token_ids:  [ prompt ............ | completion ...... ]
                [ cached (KV in cache) | scheduled | rest ]
                0              num_cached_tokens          num_tokens

A step computes `num_scheduled_tokens` tokens from `num_cached_tokens` on (KV from the
prefix cache or an earlier step); a prefill chunk that ends at `num_tokens` yields a token."""

from array import array
from collections.abc import Iterable
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams
from nanovllm.utils import cdiv


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


# The statuses as module constants too: the scheduler reads them several times per sequence per
# step, and a module constant is a cheaper read than a member through its class
# (benchmarks/host_step.py; docs/benchmarks.md has the figure).
WAITING = SequenceStatus.WAITING
RUNNING = SequenceStatus.RUNNING
FINISHED = SequenceStatus.FINISHED


class FinishReason(Enum):
    """Why a sequence finished, in vLLM's words (`.value` is what outputs report)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # abort_request(), or a failed step


class Sequence:
    _next_id = count()

    def __init__(
        self,
        token_ids: list[int],
        sampling_params: SamplingParams | None,
        block_size: int,
        eos_token_ids: Iterable[int] = (),
        parent: "Sequence | None" = None,
        index: int = 0,
        lora_int_id: int = 0,
    ):
        """n > 1: `parent` is the request's first sequence, `index` which completion this is.
        `lora_int_id`: the LoRA adapter it runs under (lora/), 0 for the base model."""
        self.seq_id = next(Sequence._next_id)
        self.status = WAITING
        self.token_ids = list(token_ids)
        self.last_token = self.token_ids[-1]
        self.num_tokens = self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = self.num_scheduled_tokens = 0
        self.is_prefill = True  # until the whole sequence has KV in the cache; again if preempted
        self.block_table = array("i")  # C ints: a step's tables are their bytes joined
        self.block_size = block_size
        self.sampling_params = sampling_params
        p = sampling_params or SamplingParams()  # None: a warmup batch's sequence
        # The token ids that end it, resolved once: its stop ids, and EOS unless ignored.
        eos = () if p.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset([*p.stop_token_ids, *eos])
        self.max_num_tokens = 0  # the length it ends at: Scheduler.add resolves it
        self.finish_reason: FinishReason | None = None
        self.stop_text: str | None = None  # the text before the stop string that ended it
        self.parent, self.index = parent, index
        self.lora_int_id = lora_int_id
        self.request_id = self.seq_id if parent is None else parent.seq_id  # add_request() gave
        self.num_prefix_cached_tokens = -1  # prompt tokens that were prefix-cache hits
        # Asked-for logprobs as they come: per completion token; per prompt token (once a request)
        self.logprobs = [] if p.logprobs is not None else None
        self.prompt_logprobs = [None] if p.prompt_logprobs is not None and parent is None else None

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs still owed: every prompt row needs logits, none from the prefix
        cache. (Workers see [] for True, None for False.)"""
        return (
            self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def num_blocks(self) -> int:
        return cdiv(self.num_tokens, self.block_size)

    def block(self, i: int) -> list[int]:
        """Token ids of the i-th block (the last one may be partial)."""
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


def logits_rows(seqs: list[Sequence]) -> list[int] | None:
    """Logits rows per sequence: its whole chunk while prompt logprobs are owed, else its
    last; None when every sequence gets one."""
    if not any(seq.prompt_logprobs is not None and seq.needs_prompt_logits for seq in seqs):
        return None
    return [seq.num_scheduled_tokens if seq.needs_prompt_logits else 1 for seq in seqs]
