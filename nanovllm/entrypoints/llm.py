"""The offline entry point (vLLM's home for it too), `from nanovllm import LLM, SamplingParams`:
generate() and chat() return vLLM's RequestOutputs, which also answer nano-vLLM's out["text"],
out["token_ids"]. Like the server, it never reaches into the scheduler."""

from numbers import Integral
from time import perf_counter

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from nanovllm.core import Sequence
from nanovllm.engine import LLMEngine, Prompt
from nanovllm.entrypoints.data_parallel import split_by_tokens, start_replicas
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams


class LLM(LLMEngine):
    """An LLMEngine with generate(), chat() and a progress bar; usable as a context manager
    (`with LLM(path) as llm: ...`) that releases memory on exit."""

    def __init__(self, model: str, **kwargs) -> None:
        super().__init__(model, **kwargs)
        # data_parallel_size > 1: generate() shares prompts with the other replicas
        self.replicas = start_replicas(self.config, self.model_runner.launch)

    def generate(
        self,
        prompts: list[Prompt] | Prompt,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; a RequestOutput per prompt, in prompt order.
        Every prompt is checked before any is queued: one bad prompt rejects the call with
        an error naming its index."""
        self._check_open()
        prompts = as_prompt_list(prompts)
        params = as_params_list(sampling_params, len(prompts))
        requests = [
            self._make_sequences(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        if self.replicas is None:
            return self._generate(prompts, requests, use_tqdm)
        return self._generate_on_replicas(prompts, params, requests, use_tqdm)

    def _generate_on_replicas(
        self,
        prompts: list[Prompt],
        params: list[SamplingParams | None],
        requests: list[list[Sequence]],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """data_parallel_size > 1: each replica runs its share (this one too); all outputs
        come back in prompt order."""
        shares = split_by_tokens(
            [self._cost(seqs) for seqs in requests], self.config.data_parallel_size
        )
        self.replicas.dispatch(shares, prompts, params)
        mine = shares[self.replicas.rank]
        try:
            local = self._generate(
                [prompts[i] for i in mine], [requests[i] for i in mine], use_tqdm
            )
        except BaseException:
            self.replicas.gather([])  # take the others' outputs: none is left for the next call
            raise
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        for share, replica_outputs in zip(shares, self.replicas.gather(local)):
            for i, output in zip(share, replica_outputs):
                outputs[i] = output
        return outputs

    def _cost(self, seqs: list[Sequence]) -> int:
        """The most tokens a request may hold in the cache, over its n sequences."""
        max_len = self.config.max_model_len
        max_tokens = seqs[0].sampling_params.max_tokens or max_len
        return len(seqs) * min(max_len, seqs[0].num_prompt_tokens + max_tokens)

    def _generate(
        self, prompts: list[Prompt], requests: list[list[Sequence]], use_tqdm: bool
    ) -> list[RequestOutput]:
        for seqs in requests:
            self._queue(seqs)
        try:
            outputs = self._run_to_completion(
                {seqs[0].seq_id: len(seqs) for seqs in requests}, use_tqdm
            )
        except BaseException:  # e.g. KeyboardInterrupt: leave no request of ours behind
            for seqs in requests:
                self.abort_request(seqs[0].seq_id)
            raise
        return [
            self._request_output(prompt, seqs, outputs) for prompt, seqs in zip(prompts, requests)
        ]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """generate() on one conversation or a list, rendered with the chat template and
        tokenized without adding special tokens (the rendered text has its own)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError(
                "messages must be a conversation (a list of {'role', 'content'} "
                "dicts) or a list of conversations"
            )
        texts = [
            self.tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            for conversation in ([messages] if isinstance(messages[0], dict) else messages)
        ]
        return self.generate(
            [
                {
                    "prompt": text,
                    "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
                }
                for text in texts
            ],
            sampling_params,
            use_tqdm,
        )

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def close(self) -> None:
        replicas, self.replicas = getattr(self, "replicas", None), None
        if replicas is not None:
            replicas.close()
        super().close()

    def _request_output(
        self, prompt: Prompt, seqs: list[Sequence], outputs: dict[tuple[int, int], CompletionOutput]
    ) -> RequestOutput:
        first = seqs[0]
        text = (
            prompt
            if isinstance(prompt, str)
            else (prompt.get("prompt") if isinstance(prompt, dict) else None)
        )
        return RequestOutput(
            str(first.seq_id),
            text,
            first.token_ids[: first.num_prompt_tokens],
            self.decode_logprobs(first.prompt_logprobs),
            [outputs[first.seq_id, seq.index] for seq in seqs],
            finished=True,
            num_cached_tokens=max(0, first.num_prefix_cached_tokens),
        )

    def _run_to_completion(
        self, requests: dict[int, int], use_tqdm: bool
    ) -> dict[tuple[int, int], CompletionOutput]:
        """Step until the engine is idle; the outputs of `requests` (id -> n) by (id, index)."""
        outputs: dict[tuple[int, int], CompletionOutput] = {}
        with tqdm(
            total=sum(requests.values()),
            desc="Generating",
            dynamic_ncols=True,
            disable=not use_tqdm,
        ) as bar:
            prefill_speed = decode_speed = 0.0
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
                for output in out.finished:
                    if output.seq_id in requests:
                        outputs[output.seq_id, output.index] = output
                        bar.update(1)
        return outputs


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
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"prompt {i}: sampling params must be a SamplingParams, got {type(params).__name__}"
            )
    return list(sampling_params)
