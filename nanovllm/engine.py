"""LLMEngine: the orchestrator. `step()` is the heartbeat:

    schedule() -> run() -> postprocess()

The scheduler (control plane) decides what runs, the model runner (data plane)
computes one token per scheduled sequence, and postprocess records the results.
"""
import os
from collections.abc import Iterator
from dataclasses import dataclass
from time import perf_counter
from typing import NamedTuple

from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.core import BlockManager, FinishReason, Scheduler, Sequence
from nanovllm.detokenizer import StopStringChecker
from nanovllm.inputs import Prompt, as_params_list, as_prompt_list, check_params, check_token_ids
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """A finished request. Unpacks as the (seq_id, token_ids) pair of earlier versions.

    token_ids: every completion token, the one that stopped it included (an EOS, a stop
    token id, or the token that completed a stop string). text: the completion's text,
    ending before whatever stopped it. finish_reason: "stop" or "length" (vLLM's words).
    """
    seq_id: int
    token_ids: list[int]
    text: str
    finish_reason: str

    def __iter__(self) -> Iterator:
        return iter((self.seq_id, self.token_ids))


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
                                   eos_token_ids=self.eos_token_ids)
        # Sampling: min_tokens keeps EOS from being drawn; stop strings are found on text.
        self.model_runner.eos_token_ids = frozenset(self.eos_token_ids)
        self.stop_strings = StopStringChecker(self.tokenizer)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        """Queue one request; returns its seq_id. Bad input raises before anything is queued."""
        params = SamplingParams() if sampling_params is None else check_params(sampling_params)
        self._check_open()
        seq = self._make_sequence(prompt, params)
        self.scheduler.add(seq)
        return seq.seq_id

    def _make_sequence(self, prompt: object, params: SamplingParams,
                       index: int | None = None) -> Sequence:
        """Tokenize and check one request without queueing it."""
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        token_ids = check_token_ids(prompt, self.config.hf_config.vocab_size, index)
        seq = Sequence(token_ids, params, self.config.kvcache_block_size)
        try:
            self.scheduler.check_fits(seq)
        except ValueError as e:
            raise ValueError(f"prompt {index}: {e}" if index is not None else str(e)) from None
        return seq

    def abort_request(self, seq_id: int) -> bool:
        """Drop a pending request and free its KV blocks; False if it is not pending."""
        self.stop_strings.discard(seq_id)
        return self.scheduler.abort(seq_id)

    def _check_open(self) -> None:
        if self.model_runner is None:
            raise RuntimeError("this engine is closed; create a new LLM to generate again")

    def step(self) -> StepOutput:
        self._check_open()
        try:
            seqs, is_prefill = self.scheduler.schedule()
            num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
            token_ids = self.model_runner.call("run", seqs, is_prefill)
            finished = self.scheduler.postprocess(seqs, token_ids)
            stop_texts = self._check_stop_strings(seqs, finished)
        except BaseException:
            # A failed step leaves half-updated sequences: drop them all, keep the engine usable.
            for seq_id in self.scheduler.abort_all():
                self.stop_strings.discard(seq_id)
            raise
        return StepOutput([self._completion_output(seq, stop_texts.get(seq.seq_id))
                           for seq in finished],
                          num_prefill_tokens=num_tokens if is_prefill else 0,
                          num_decode_tokens=0 if is_prefill else num_tokens)

    def _check_stop_strings(self, seqs: list[Sequence], finished: list[Sequence]) -> dict[int, str]:
        """Finish (blocks freed now) the sequences whose new tokens completed a stop
        string, appending them to `finished`; returns seq_id -> text before the stop string."""
        texts = {}
        for seq in seqs:
            if (not seq.sampling_params.stop or seq.is_prefill  # no stop strings / no new token
                    or seq.finish_reason is FinishReason.STOP):  # a stop token came first
                continue
            text = self.stop_strings.check(seq)
            if text is None:
                continue
            texts[seq.seq_id] = text
            if seq.is_finished:  # the length cap came with it: the stop string outranks it
                seq.finish_reason = FinishReason.STOP
            else:
                self.scheduler.finish(seq, FinishReason.STOP)
                finished.append(seq)
        for seq in finished:
            self.stop_strings.discard(seq.seq_id)
        return texts

    def _completion_output(self, seq: Sequence, stop_text: str | None) -> CompletionOutput:
        token_ids = seq.completion_token_ids
        if stop_text is not None:
            text = stop_text
        elif seq.finish_reason is FinishReason.STOP:  # EOS or a stop token id: not in text
            text = self.tokenizer.decode(token_ids[:-1])
        else:
            text = self.tokenizer.decode(token_ids)
        return CompletionOutput(seq.seq_id, token_ids, text, seq.finish_reason.value)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def generate(self, prompts: list[Prompt] | str,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Run every prompt to completion; outputs come back in prompt order as
        {"text": str, "token_ids": list[int], "finish_reason": "stop" | "length"}.
        Every prompt is checked before any is queued: one bad prompt rejects the call with
        an error naming its index."""
        self._check_open()
        prompts = as_prompt_list(prompts)
        params = as_params_list(sampling_params, len(prompts))
        seqs = [self._make_sequence(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))]
        for seq in seqs:
            self.scheduler.add(seq)
        try:
            outputs = self._run_to_completion({seq.seq_id for seq in seqs}, use_tqdm)
        except BaseException:  # e.g. KeyboardInterrupt: leave no request of ours behind
            for seq in seqs:
                self.abort_request(seq.seq_id)
            raise
        return [{"text": outputs[seq.seq_id].text, "token_ids": outputs[seq.seq_id].token_ids,
                 "finish_reason": outputs[seq.seq_id].finish_reason} for seq in seqs]

    def _run_to_completion(self, seq_ids: set[int], use_tqdm: bool) -> dict[int, CompletionOutput]:
        """Step until the engine is idle; the outputs of `seq_ids`."""
        outputs: dict[int, CompletionOutput] = {}
        with tqdm(total=len(seq_ids), desc="Generating", dynamic_ncols=True,
                  disable=not use_tqdm) as bar:
            prefill_speed = decode_speed = 0.0
            while not self.is_finished():
                start = perf_counter()
                out = self.step()
                elapsed = perf_counter() - start
                if out.num_prefill_tokens:
                    prefill_speed = out.num_prefill_tokens / elapsed
                if out.num_decode_tokens:
                    decode_speed = out.num_decode_tokens / elapsed
                bar.set_postfix(prefill=f"{prefill_speed:.0f}tok/s", decode=f"{decode_speed:.0f}tok/s",
                                refresh=False)
                for output in out.finished:
                    if output.seq_id in seq_ids:
                        outputs[output.seq_id] = output
                        bar.update(1)
        return outputs

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
