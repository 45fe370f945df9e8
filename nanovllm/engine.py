"""LLMEngine: the orchestrator. `step()` is the heartbeat:

    schedule() -> run() -> postprocess()

The scheduler (control plane) decides what runs and which requests end, the model runner
(data plane) computes one token per scheduled sequence.
"""
import os
from dataclasses import dataclass
from numbers import Integral
from typing import NamedTuple

from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.core import BlockManager, FinishReason, Scheduler, Sequence
from nanovllm.detokenizer import StopStringChecker
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """A finished request. token_ids: every completion token, the one that stopped it
    included (an EOS, a stop token id, or the token that completed a stop string). text:
    the completion's text, ending before whatever stopped it. finish_reason: "stop",
    "length" or "abort" (vLLM's words)."""
    seq_id: int
    token_ids: list[int]
    text: str
    finish_reason: str


class StepOutput(NamedTuple):
    finished: list[CompletionOutput]  # the requests that finished this step
    num_prefill_tokens: int           # prompt tokens computed this step
    num_decode_tokens: int            # decode tokens computed this step


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        self.config = config = Config.from_kwargs(model, kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.eos_token_ids = find_eos_token_ids(config, self.tokenizer)
        self.model_runner = ModelRunner(config)
        block_manager = BlockManager(self.model_runner.num_kvcache_blocks,
                                     config.kvcache_block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=config.max_model_len,
                                   stop_strings=StopStringChecker(self.tokenizer),
                                   policy=config.scheduling_policy)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        """Queue one request; returns its seq_id. Bad input raises before anything is queued."""
        seq = self._make_sequence(prompt, sampling_params)
        self.scheduler.add(seq)
        return seq.seq_id

    def _make_sequence(self, prompt: object, params: object, index: int | None = None) -> Sequence:
        """Tokenize and check one request without queueing it; errors name `index`."""
        self._check_open()
        where = "" if index is None else f"prompt {index}: "
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"{where}sampling params must be a SamplingParams, got "
                            f"{type(params).__name__}")
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        try:
            token_ids = check_token_ids(prompt, self.config.hf_config.vocab_size)
            seq = Sequence(token_ids, params, self.config.kvcache_block_size, self.eos_token_ids)
            self.scheduler.check_fits(seq)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}{e}") from None
        return seq

    def abort_request(self, seq_id: int) -> bool:
        """Drop a pending request and free its KV blocks; False if it is not pending."""
        return self.scheduler.abort(seq_id)

    def _check_open(self) -> None:
        if self.model_runner is None:
            raise RuntimeError("this engine is closed; create a new LLM to generate again")

    def step(self) -> StepOutput:
        """One step of every pending request; an idle engine does nothing."""
        self._check_open()
        try:
            seqs = self.scheduler.schedule()
            if not seqs:
                return StepOutput([], 0, 0)
            num_decode = sum(1 for seq in seqs if not seq.is_prefill)
            num_prefill = sum(seq.num_scheduled_tokens for seq in seqs) - num_decode
            token_ids = self.model_runner.call("run", seqs)
            finished = self.scheduler.postprocess(seqs, token_ids)
        except BaseException:
            # A failed step leaves half-updated sequences: drop them all, keep the engine usable.
            self.scheduler.abort_all()
            raise
        return StepOutput([self._completion_output(seq) for seq in finished],
                          num_prefill_tokens=num_prefill, num_decode_tokens=num_decode)

    def _completion_output(self, seq: Sequence) -> CompletionOutput:
        token_ids = seq.completion_token_ids
        if seq.stop_text is not None:
            text = seq.stop_text
        elif seq.finish_reason is FinishReason.STOP:  # EOS or a stop token id: not in text
            text = self.tokenizer.decode(token_ids[:-1])
        else:
            text = self.tokenizer.decode(token_ids)
        return CompletionOutput(seq.seq_id, token_ids, text, seq.finish_reason.value)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def close(self) -> None:
        """Release the KV cache and the model's device memory; harmless to call twice."""
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            runner.close()
            self.model_runner = None

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_token_ids(token_ids: object, vocab_size: int) -> list[int]:
    """A prompt's token ids as a list of ints in [0, vocab_size)."""
    if not isinstance(token_ids, (list, tuple)):
        raise TypeError(f"a prompt must be a string or a list of token ids, got "
                        f"{type(token_ids).__name__}")
    if not token_ids:
        raise ValueError("the prompt is empty; give at least one token")
    for token in token_ids:
        if isinstance(token, bool) or not isinstance(token, Integral):
            raise TypeError(f"token ids must be ints, got {type(token).__name__} ({token!r})")
        if not 0 <= token < vocab_size:
            raise ValueError(f"token id {token} is outside the model's vocabulary "
                             f"[0, {vocab_size})")
    return [int(t) for t in token_ids]


def find_eos_token_ids(config: Config, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The tokenizer's EOS plus generation_config.json's (an int or a list), as
    `transformers` generate() stops on; config.json's when there is no generation config."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if os.path.isfile(os.path.join(config.model, "generation_config.json")):
        eos = GenerationConfig.from_pretrained(config.model).eos_token_id
    else:
        eos = getattr(config.hf_config, "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    return ids
