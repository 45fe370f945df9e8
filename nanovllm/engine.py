"""LLMEngine: `step()` is the heartbeat, schedule() -> run() -> advance() + accept(). The scheduler
decides what runs and what ends; the model runner computes a token per scheduled sequence."""

import os
from dataclasses import replace
from functools import partial
from numbers import Integral
from typing import NamedTuple

from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.core import BlockManager, FinishReason, Scheduler, Sequence
from nanovllm.detokenizer import StopStringChecker
from nanovllm.outputs import CompletionOutput
from nanovllm.runner.model_runner import ModelRunner, SamplerOutput
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int] | dict  # dict: vLLM's TextPrompt or TokensPrompt


class NewToken(NamedTuple):
    request_id: int  # what add_request returned
    index: int  # which of the request's n completions
    token_id: int
    logprobs: dict | None  # its logprob entry if asked for (decoded_token not filled in)


class StepOutput(NamedTuple):
    finished: list[CompletionOutput]  # the sequences that finished this step
    num_prefill_tokens: int  # prompt tokens computed this step
    num_decode_tokens: int  # decode tokens computed this step
    new_tokens: list[NewToken] = []  # every sequence's token of this step, finished or not


class EngineStats(NamedTuple):
    num_running: int  # sequences holding KV blocks
    num_waiting: int  # sequences queued (preempted ones included)
    kv_cache_usage: float  # fraction of KV blocks held by a sequence


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        self.config = config = Config.from_kwargs(model, kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.eos_token_ids = find_eos_token_ids(config, self.tokenizer)
        self.model_runner = ModelRunner(config)
        self.in_flight: tuple[list[Sequence], SamplerOutput] | None = None  # async scheduling
        block_manager = BlockManager(
            self.model_runner.num_kvcache_blocks,
            config.kvcache_block_size,
            config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            stop_strings=StopStringChecker(self.tokenizer),
            policy=config.scheduling_policy,
        )

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        """Queue one request (its n sequences); returns its id, the `seq_id` of its
        outputs. Bad input raises before anything is queued."""
        return self._queue(self._make_sequences(prompt, sampling_params))

    def _queue(self, seqs: list[Sequence]) -> int:
        """Queue a request's sequences that _make_sequences built; its id."""
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs[0].seq_id

    def _make_sequences(
        self, prompt: object, params: object, index: int | None = None
    ) -> list[Sequence]:
        """Tokenize and check one request (n sequences; the i-th's seed is seed + i, as vLLM's)
        without queueing it; errors name `index`."""
        self._check_open()
        where = "" if index is None else f"prompt {index}: "
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise TypeError(
                f"{where}sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        try:
            vocab_size = self.config.hf_config.vocab_size
            token_ids = check_token_ids(self._prompt_token_ids(prompt), vocab_size)
            for name in ("stop_token_ids", "logit_bias"):  # bad ids would fail in the sampler
                if bad := [t for t in getattr(params, name) if t >= vocab_size]:
                    raise ValueError(
                        f"{name}: token id {bad[0]} is outside the model's "
                        f"vocabulary [0, {vocab_size})"
                    )
            seq = Sequence(token_ids, params, self.config.kvcache_block_size, self.eos_token_ids)
            self.scheduler.check_fits(seq)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}{e}") from None
        return [seq] + [
            Sequence(
                token_ids,
                params if params.seed is None else replace(params, seed=params.seed + i),
                self.config.kvcache_block_size,
                self.eos_token_ids,
                seq,
                i,
            )
            for i in range(1, params.n)
        ]

    def _prompt_token_ids(self, prompt: object) -> object:
        """A prompt's token ids (checked by the caller); text is tokenized as vLLM does
        (with the tokenizer's special tokens)."""
        if isinstance(prompt, dict):
            if not prompt or set(prompt) - {"prompt", "prompt_token_ids"}:
                raise ValueError(
                    f"a prompt dict takes 'prompt' (vLLM's TextPrompt) or "
                    f"'prompt_token_ids' (TokensPrompt), got keys {sorted(prompt)}"
                )
            if "prompt_token_ids" in prompt:
                return prompt["prompt_token_ids"]
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise TypeError(f"'prompt' must be a string, got {type(prompt).__name__}")
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

    def abort_request(self, request_id: int) -> bool:
        """Drop a pending request (its n sequences), free their blocks; False if not pending."""
        return self.scheduler.abort(request_id)

    def _check_open(self) -> None:
        if self.model_runner is None:
            raise RuntimeError("this engine is closed; create a new LLM to generate again")

    def step(self) -> StepOutput:
        """One step of every pending request; an idle engine does nothing. With async
        scheduling a step is queued on the device before the one in flight is read, whose
        tokens (and finished sequences) this step reports."""
        self._check_open()
        try:
            seqs = self.scheduler.schedule()
            previous, self.in_flight, accepted = self.in_flight, None, []
            # Penalties count a batch's tokens on the host: the step in flight is read first.
            if previous is not None and (
                not seqs or any(seq.sampling_params.has_penalties for seq in seqs)
            ):
                accepted, previous = self._accept(*previous), None
            num_decode = next((i for i, seq in enumerate(seqs) if seq.is_prefill), len(seqs))
            num_prefill = sum(seq.num_scheduled_tokens for seq in seqs[num_decode:])  # rows first
            if seqs:  # async: only queued on the device, its tokens read by the next step
                out = (
                    self.model_runner.execute_model(seqs)
                    if self.config.async_scheduling
                    else self.model_runner.run(seqs)
                )
            if previous is not None:
                accepted = self._accept(*previous)  # step n's tokens, while n + 1 runs
            self.scheduler.advance(seqs)
            if seqs and not self.config.async_scheduling:
                accepted = self._accept(seqs, out)
            elif seqs and not self.scheduler.is_finished():  # finished: all its tokens dropped
                self.in_flight = seqs, out
        except BaseException:
            # A failed step leaves half-updated sequences: drop them all, keep the engine usable.
            self.in_flight = None
            self.scheduler.abort_all()
            raise
        # tuple.__new__: what NewToken._make does, without its Python frame (3x faster)
        new_tokens = [
            tuple.__new__(
                NewToken,
                (
                    seq.request_id,
                    seq.index,
                    seq.last_token,
                    seq.logprobs[-1] if seq.logprobs else None,
                ),
            )
            for seq in accepted
        ]
        return StepOutput(
            [self._completion_output(seq) for seq in accepted if seq.is_finished],
            num_prefill,
            num_decode,
            new_tokens,
        )

    def _accept(self, seqs: list[Sequence], out: SamplerOutput) -> list[Sequence]:
        """Read a launched step's tokens (and logprobs) into its sequences, but those that
        ended while it ran; the sequences that took one."""
        tokens = out.token_ids if isinstance(out.token_ids, list) else out.token_ids.tolist()
        for seq, entry in zip(seqs, out.logprobs or ()):
            if entry is not None and not seq.is_finished:
                seq.logprobs.append(entry)
        for seq, entries in zip(seqs, out.prompt_logprobs or ()):
            if entries and not seq.is_finished:
                seq.prompt_logprobs.extend(entries)
        return self.scheduler.accept(seqs, tokens)

    def _completion_output(self, seq: Sequence) -> CompletionOutput:
        token_ids = seq.completion_token_ids
        text, stop_reason = self._text(seq)
        logprobs = self.decode_logprobs(seq.logprobs)
        cumulative = (
            None
            if logprobs is None
            else sum(entries[token].logprob for entries, token in zip(logprobs, token_ids))
        )
        return CompletionOutput(
            seq.index,
            text,
            token_ids,
            cumulative,
            logprobs,
            seq.finish_reason.value,
            stop_reason,
            seq.request_id,
        )

    def _text(self, seq: Sequence) -> tuple[str, int | str | None]:
        """The completion's text and stop_reason. Which stop string ended it is found again
        in the whole decode, of which the incremental text is a prefix."""
        params, token_ids = seq.sampling_params, seq.completion_token_ids
        decode = partial(self.tokenizer.decode, skip_special_tokens=params.skip_special_tokens)
        if seq.stop_text is not None:
            text = decode(token_ids)
            stop = next((s for s in params.stop if text.startswith(s, len(seq.stop_text))), None)
            return seq.stop_text + ((stop or "") if params.include_stop_str_in_output else ""), stop
        if seq.finish_reason is not FinishReason.STOP:
            return decode(token_ids), None
        # EOS or a stop token id: out of the text unless include_stop_str_in_output
        text = decode(token_ids if params.include_stop_str_in_output else token_ids[:-1])
        is_eos = not params.ignore_eos and seq.last_token in self.eos_token_ids
        return text, None if is_eos else seq.last_token

    def decode_logprobs(self, entries: list[dict | None] | None) -> list[dict | None] | None:
        """Fill in each Logprob's decoded_token (each token decoded alone, as vLLM does)."""
        for entry in entries or ():
            for token, logprob in (entry or {}).items():
                logprob.decoded_token = self.tokenizer.decode([token])
        return entries

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()  # a step in flight then holds only dropped tokens

    def stats(self) -> EngineStats:
        blocks = self.scheduler.block_manager
        return EngineStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            1 - blocks.num_free_blocks / blocks.num_blocks,
        )

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
        raise TypeError(
            f"a prompt must be a string or a list of token ids, got {type(token_ids).__name__}"
        )
    if not token_ids:
        raise ValueError("the prompt is empty; give at least one token")
    for token in token_ids:
        if isinstance(token, bool) or not isinstance(token, Integral):
            raise TypeError(f"token ids must be ints, got {type(token).__name__} ({token!r})")
        if not 0 <= token < vocab_size:
            raise ValueError(
                f"token id {token} is outside the model's vocabulary [0, {vocab_size})"
            )
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
