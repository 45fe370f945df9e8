"""The offline entry point (vLLM's home for it too), `from nanovllm import LLM, SamplingParams`:
generate() and chat() return vLLM's RequestOutputs, which also answer nano-vLLM's out["text"],
out["token_ids"]. Like the server, it uses only the engine's public API."""

from functools import partial
from numbers import Integral
from time import perf_counter
from typing import TYPE_CHECKING

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from nanovllm.engine import LLMEngine, Prompt
from nanovllm.engine.llm_engine import EngineRequest
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.lora.request import LoRARequest


class LLM(LLMEngine):
    """An LLMEngine with generate(), chat() and a progress bar; usable as a context manager
    (`with LLM(path) as llm: ...`) that releases memory on exit."""

    def __init__(self, model: str, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.replicas = None  # data_parallel_size > 1: the other engines generate() shares with
        if self.config.data_parallel_size > 1:
            from nanovllm.distributed.data_parallel import start_replicas

            self.replicas = start_replicas(self.config, type(self))

    def generate(
        self,
        prompts: list[Prompt] | Prompt,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: "LoRARequest | list[LoRARequest | None] | None" = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; a RequestOutput per prompt, in prompt order.
        Every prompt is checked before any is queued: one bad prompt rejects the call with
        an error naming its index. `lora_request`: one LoRA adapter for all, or one (or None)
        per prompt (enable_lora)."""
        self.check_open()
        prompts = as_prompt_list(prompts)
        params = as_params_list(sampling_params, len(prompts))
        loras = as_per_prompt(lora_request, len(prompts), "lora_request")
        if self.replicas is not None and lora_request is not None:
            raise ValueError("lora_request is not supported with data_parallel_size > 1")
        requests = [
            self.make_request(p, sp, i, lora)
            for i, (p, sp, lora) in enumerate(zip(prompts, params, loras))
        ]
        if self.replicas is not None:
            generate_here = partial(self._generate, use_tqdm=use_tqdm)
            return self.replicas.generate(prompts, params, requests, generate_here)
        return self._generate(requests, use_tqdm)

    def _generate(self, requests: list[EngineRequest], use_tqdm: bool) -> list[RequestOutput]:
        ids = [self.add_request(request) for request in requests]
        num_completions = sum(request.sampling_params.n for request in requests)
        try:
            outputs = self._run_to_completion(set(ids), num_completions, use_tqdm)
        except BaseException:  # e.g. KeyboardInterrupt: leave no request of ours behind
            for request_id in ids:
                self.abort_request(request_id)
            raise
        return [outputs[request_id] for request_id in ids]

    def _run_to_completion(
        self, ids: set[int], num_completions: int, use_tqdm: bool
    ) -> dict[int, RequestOutput]:
        """Step until the engine is idle; the RequestOutputs of `ids`, by id. The progress bar
        counts completions and shows the last prefill and decode step's throughput."""
        outputs: dict[int, RequestOutput] = {}
        bar = tqdm(
            total=num_completions, desc="Generating", dynamic_ncols=True, disable=not use_tqdm
        )
        prefill_speed = decode_speed = 0.0
        with bar:
            while not self.is_finished():
                start = perf_counter()
                out = self.step()
                elapsed = perf_counter() - start
                if out.num_prefill_tokens:
                    prefill_speed = out.num_prefill_tokens / elapsed
                if out.num_decode_tokens:
                    decode_speed = out.num_decode_tokens / elapsed
                bar.set_postfix(
                    prefill=f"{prefill_speed:.0f}tok/s",
                    decode=f"{decode_speed:.0f}tok/s",
                    refresh=False,
                )
                bar.update(sum(output.seq_id in ids for output in out.finished))
                for output in out.finished_requests:
                    if int(output.request_id) in ids:
                        outputs[int(output.request_id)] = output
        return outputs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: "LoRARequest | list[LoRARequest | None] | None" = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """generate() on one conversation or a list, rendered with the chat template and
        tokenized without adding special tokens (the rendered text has its own)."""
        from nanovllm.entrypoints.chat import render_conversations

        prompts = render_conversations(
            self.tokenizer, messages, chat_template, add_generation_prompt, chat_template_kwargs
        )
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def close(self) -> None:
        replicas, self.replicas = getattr(self, "replicas", None), None
        if replicas is not None:
            replicas.close()
        super().close()


def as_prompt_list(prompts: object) -> list[Prompt]:
    """A single string (or prompt dict) is one prompt; otherwise a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}"
        )
    if prompts and all(isinstance(p, Integral) and not isinstance(p, bool) for p in prompts):
        raise TypeError(
            "prompts is a flat list of ints; wrap one tokenized prompt in a list: [[1, 2, 3]]"
        )
    return list(prompts)


def as_per_prompt(value: object, num_prompts: int, name: str) -> list:
    """One entry per prompt: a list is taken as given (its length checked), anything else is
    the same for every prompt (the callee checks its type)."""
    if not isinstance(value, (list, tuple)):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise ValueError(
            f"got {len(value)} {name}s for {num_prompts} prompts; pass one or one each"
        )
    return list(value)


def as_params_list(sampling_params: object, num_prompts: int) -> list[SamplingParams | None]:
    """One entry per prompt."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(
            f"sampling_params must be a SamplingParams or a list of them, got "
            f"{type(sampling_params).__name__}"
        )
    if len(sampling_params) != num_prompts:
        raise ValueError(
            f"got {len(sampling_params)} sampling params for {num_prompts} prompts; "
            "pass one SamplingParams for all, or exactly one per prompt"
        )
    for i, params in enumerate(sampling_params):
        if not isinstance(params, SamplingParams):  # None too: only a lone None means defaults
            raise TypeError(
                f"prompt {i}: sampling params must be a SamplingParams, got {type(params).__name__}"
            )
    return list(sampling_params)
