"""The public entry point: `from nanovllm import LLM, SamplingParams`.

    llm = LLM("~/huggingface/Qwen3-0.6B/")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.6, max_tokens=64))
    outputs[0]["text"], outputs[0]["token_ids"]
"""
from numbers import Integral
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.engine import CompletionOutput, LLMEngine, Prompt
from nanovllm.sampling_params import SamplingParams


class LLM(LLMEngine):
    """An LLMEngine with generate() and a progress bar; usable as a context manager
    (`with LLM(path) as llm: ...`) that releases memory on exit."""

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


def as_prompt_list(prompts: object) -> list[Prompt]:
    """A single string is one prompt; otherwise a list of strings / token-id lists."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of strings or of token-id lists, got "
                        f"{type(prompts).__name__}")
    if prompts and all(isinstance(p, Integral) and not isinstance(p, bool) for p in prompts):
        raise TypeError("prompts is a flat list of ints; wrap one tokenized prompt in a list: "
                        "[[1, 2, 3]]")
    return list(prompts)


def as_params_list(sampling_params: object, num_prompts: int) -> list[SamplingParams | None]:
    """One entry per prompt."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(sampling_params).__name__}")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"got {len(sampling_params)} sampling params for {num_prompts} prompts; "
                         "pass one SamplingParams for all, or exactly one per prompt")
    for i, params in enumerate(sampling_params):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"prompt {i}: sampling params must be a SamplingParams, got "
                            f"{type(params).__name__}")
    return list(sampling_params)
