"""LLMEngine: `step()` is the heartbeat, schedule -> run -> postprocess. The scheduler decides
what runs and what ends; the model runner computes a token per scheduled sequence. How a step
goes is its step loop's (loop.py): the synchronous one by default, or async scheduling's
(overlap.py) or speculative decoding's (speculative.py), chosen once when the engine is built."""

import os
from dataclasses import dataclass, replace
from functools import partial
from numbers import Integral
from typing import TYPE_CHECKING, NamedTuple

from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import FinishReason, Sequence
from nanovllm.engine.loop import StepLoop, StepResult, SyncLoop, TakenToken
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.lora.request import LoRARequest
    from nanovllm.speculative.metrics import SpecDecodeStats
    from nanovllm.structured import StructuredOutputs

Prompt = str | list[int] | dict  # dict: vLLM's TextPrompt or TokensPrompt


@dataclass(slots=True)
class EngineRequest:
    """A request tokenized and checked by make_request(), not queued yet."""

    prompt: str | None  # its text; None for a token-id prompt
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    lora_int_id: int = 0  # the LoRA adapter it runs under; 0: the base model


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
    finished_requests: list[RequestOutput] = []  # the requests whose last completion ended
    spec_decode: "SpecDecodeStats | None" = None  # this step's drafts, with speculation


class EngineStats(NamedTuple):
    num_running: int  # sequences holding KV blocks
    num_waiting: int  # sequences queued (preempted ones included)
    kv_cache_usage: float  # fraction of KV blocks held by a sequence
    spec_decode: "SpecDecodeStats | None" = None  # drafts since the start, with speculation


@dataclass(slots=True)
class _Pending:
    """A queued request, until its last completion finishes."""

    request: EngineRequest
    seqs: list[Sequence]
    outputs: list[CompletionOutput | None]  # by index, as they finish


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        self.config = config = Config.from_kwargs(model, kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model, gguf_file=config.gguf_file)
        self.eos_token_ids = find_eos_token_ids(config, self.tokenizer)
        self.model_runner = ModelRunner(config)
        block_manager = BlockManager(
            self.model_runner.num_kvcache_blocks,
            config.kvcache_block_size,
            config.enable_prefix_caching,
        )
        loop = select_loop(config)  # synchronous, or a seam's: async scheduling, speculation
        self.scheduler = loop.make_scheduler(block_manager, config)
        self.loop = loop(self.scheduler, self.model_runner)
        self.requests: dict[int, _Pending] = {}  # request id -> its state, until it finishes
        self.structured_outputs: StructuredOutputs | None = None  # with the first grammar
        self.spec_decode: SpecDecodeStats | None = None  # drafts since the start, with speculation
        if config.speculative_config is not None:
            from nanovllm.speculative import metrics

            self.spec_decode = metrics.SpecDecodeStats()

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self, prompt: Prompt | EngineRequest, sampling_params: SamplingParams | None = None
    ) -> int:
        """Queue one request (its n sequences); returns its id, the `seq_id` of its outputs.
        Bad input raises before anything is queued. `prompt` may be make_request()'s result."""
        if not isinstance(prompt, EngineRequest):
            prompt = self.make_request(prompt, sampling_params)
        elif prompt.lora_int_id and prompt.lora_int_id not in self.list_loras():
            raise ValueError(f"LoRA adapter {prompt.lora_int_id} is not loaded (removed since?)")
        seqs = self._sequences(prompt)
        if prompt.sampling_params.stop and self.scheduler.stop_strings is None:
            from nanovllm.engine.detokenizer import StopStringChecker  # the first with some

            self.scheduler.stop_strings = StopStringChecker(self.tokenizer)
        for seq in seqs:
            self.scheduler.add(seq)
        self.requests[seqs[0].seq_id] = _Pending(prompt, seqs, [None] * len(seqs))
        return seqs[0].seq_id

    def make_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        index: int | None = None,
        lora_request: "LoRARequest | None" = None,
    ) -> EngineRequest:
        """Tokenize and check a request without queueing it; an error names `index` (a
        prompt's place in a list), if given. `lora_request`: the adapter it runs under, read
        and checked now (enable_lora)."""
        self.check_open()
        where = "" if index is None else f"prompt {index}: "
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"{where}sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        try:
            text, token_ids = self._tokenize(prompt)
            vocab_size = self.config.hf_config.vocab_size
            token_ids = check_token_ids(token_ids, vocab_size)
            check_ids_in_vocabulary(params, vocab_size)  # bad ids would fail in the sampler
            if max(params.logprobs or 0, params.prompt_logprobs or 0) > self.config.max_logprobs:
                raise ValueError(f"logprobs may be at most max_logprobs={self.config.max_logprobs}")
            if params.structured_outputs is not None:  # its grammar compiled now: structured/
                self.prepare_structured_outputs(params)
            self.loop.check(params)  # what the step loop cannot do
            self.scheduler.check_fits(len(token_ids), params.max_tokens)
            lora_int_id = 0
            if lora_request is not None:
                self.add_lora(lora_request)
                lora_int_id = lora_request.lora_int_id
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}{e}") from None
        return EngineRequest(text, token_ids, params, lora_int_id)

    def _tokenize(self, prompt: object) -> tuple[str | None, object]:
        """A prompt's text and token ids (checked by the caller); text is tokenized as vLLM
        does, with the tokenizer's special tokens."""
        if isinstance(prompt, dict):
            if not prompt or set(prompt) - {"prompt", "prompt_token_ids"}:
                raise ValueError(
                    f"a prompt dict takes 'prompt' (vLLM's TextPrompt) or "
                    f"'prompt_token_ids' (TokensPrompt), got keys {sorted(prompt)}"
                )
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"'prompt' must be a string, got {type(text).__name__}")
            if "prompt_token_ids" in prompt:
                return text, prompt["prompt_token_ids"]
            prompt = text
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, prompt

    def prepare_structured_outputs(self, params: SamplingParams) -> None:
        """Check a constrained request and compile its grammar (once per distinct constraint;
        thread-safe: the server compiles off the engine thread). The engine's StructuredOutputs
        is made with the first, its grammar matchers a logits hook of the sampler."""
        from nanovllm.structured import StructuredOutputs, check_request

        vocab_size = self.config.hf_config.vocab_size
        check_request(params, self.eos_token_ids, vocab_size)
        with StructuredOutputs.lock:
            if self.structured_outputs is None:
                device = self.model_runner.device
                self.structured_outputs = StructuredOutputs(self.tokenizer, vocab_size, device)
                self.model_runner.add_logits_hook(self.structured_outputs.matchers)
        self.structured_outputs.compile(params.structured_outputs)

    def _sequences(self, request: EngineRequest) -> list[Sequence]:
        """A request's n sequences; the i-th's seed is seed + i, as vLLM's."""
        params, block_size = request.sampling_params, self.config.kvcache_block_size
        eos, lora = self.eos_token_ids, request.lora_int_id
        first = Sequence(request.prompt_token_ids, params, block_size, eos, lora_int_id=lora)
        seqs = [first]
        for i in range(1, params.n):
            own = params if params.seed is None else replace(params, seed=params.seed + i)
            seqs.append(Sequence(first.token_ids, own, block_size, eos, first, i, lora))
        return seqs

    # -- LoRA adapters (vLLM's LLMEngine API), with enable_lora ------------------------------

    def add_lora(self, lora_request: "LoRARequest") -> bool:
        """Read and check a PEFT adapter and load it on every rank; False if it was known
        already. A bad one is a ValueError (TypeError for a wrong type), nothing kept."""
        from nanovllm.lora.request import LoRARequest

        self._check_lora_enabled()
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(
                f"lora_request must be a LoRARequest (nanovllm.lora.request), got "
                f"{type(lora_request).__name__}"
            )
        return self.model_runner.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if it is unknown. A ValueError while a request uses it."""
        self._check_lora_enabled()
        pending = (*self.scheduler.waiting, *self.scheduler.running)
        if users := sum(seq.lora_int_id == lora_int_id for seq in pending):
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by {users} sequence(s)")
        return self.model_runner.call("lora_call", "remove", lora_int_id)

    def list_loras(self) -> set[int]:
        """The lora_int_ids of the adapters added."""
        self._check_lora_enabled()
        return self.model_runner.lora_call("lora_ids")

    def _check_lora_enabled(self) -> None:
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters need LLM(..., enable_lora=True)")

    def abort_request(self, request_id: int) -> bool:
        """Drop a pending request (its n sequences), free their blocks; False if not pending."""
        self.requests.pop(request_id, None)
        return self.scheduler.abort(request_id)

    # -- the step ------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """One step of every pending request: schedule -> run -> postprocess (the step loop's).
        An idle engine does nothing."""
        self.check_open()
        try:
            result = self.loop.step()
        except BaseException:
            self._drop_all_requests()
            raise
        return self.step_output(result)

    def step_output(self, result: StepResult) -> StepOutput:
        """The outputs of what a step did: its new tokens, and the completions and requests it
        finished."""
        taken = result.taken
        if taken is None:  # a token each: with its logprob entry, if asked for
            taken = [
                TakenToken(s, s.last_token, (s.logprobs or [None])[-1]) for s in result.accepted
            ]
        new_tokens = [
            NewToken(t.seq.request_id, t.seq.index, t.token_id, t.logprobs) for t in taken
        ]
        finished = [self._completion_output(seq) for seq in result.accepted if seq.is_finished]
        if result.spec_decode is not None:
            self.spec_decode.add(result.spec_decode)
        return StepOutput(
            finished,
            result.num_prefill_tokens,
            result.num_decode_tokens,
            new_tokens,
            self._finish_requests(finished),
            result.spec_decode,
        )

    def _drop_all_requests(self) -> None:
        """After a failed step: its sequences are half-updated, so every request is dropped
        and the engine stays usable."""
        self.loop.reset()
        self.scheduler.abort_all()
        self.requests.clear()

    # -- outputs -------------------------------------------------------------------------

    def _completion_output(self, seq: Sequence) -> CompletionOutput:
        token_ids = seq.completion_token_ids
        text, stop_reason = self._completion_text(seq)
        logprobs = self.decode_logprobs(seq.logprobs)
        cumulative = None
        if logprobs is not None:
            cumulative = sum(entry[token].logprob for entry, token in zip(logprobs, token_ids))
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

    def _completion_text(self, seq: Sequence) -> tuple[str, int | str | None]:
        """A finished completion's text and vLLM's stop_reason (the stop string or stop token id
        that ended it; None for EOS, length or abort). Which stop string ended it is found again
        in the whole decode, of which the incremental text is a prefix."""
        params, token_ids = seq.sampling_params, seq.completion_token_ids
        decode = partial(self.tokenizer.decode, skip_special_tokens=params.skip_special_tokens)
        if seq.stop_text is not None:  # a stop string: which, its checker finds (detokenizer.py)
            return self.scheduler.stop_strings.completion_text(seq, decode(token_ids))
        if seq.finish_reason is not FinishReason.STOP:  # length or abort
            return decode(token_ids), None
        # EOS or a stop token id: out of the text unless include_stop_str_in_output
        text = decode(token_ids if params.include_stop_str_in_output else token_ids[:-1])
        is_eos = not params.ignore_eos and seq.last_token in self.eos_token_ids
        return text, None if is_eos else seq.last_token

    def _finish_requests(self, finished: list[CompletionOutput]) -> list[RequestOutput]:
        """The RequestOutputs of the requests whose last completion is among `finished`."""
        done = []
        for output in finished:
            pending = self.requests.get(output.seq_id)
            if pending is None:
                continue
            pending.outputs[output.index] = output
            if all(o is not None for o in pending.outputs):
                del self.requests[output.seq_id]
                done.append(self._request_output(pending))
        return done

    def _request_output(self, pending: _Pending) -> RequestOutput:
        first, request = pending.seqs[0], pending.request
        return RequestOutput(
            str(first.seq_id),
            request.prompt,
            request.prompt_token_ids,
            self.decode_logprobs(first.prompt_logprobs),
            pending.outputs,
            finished=True,
            num_cached_tokens=max(0, first.num_prefix_cached_tokens),
        )

    def decode_logprobs(self, entries: list[dict | None] | None) -> list[dict | None] | None:
        """Fill in each Logprob's decoded_token (each token decoded alone, as vLLM does)."""
        for entry in entries or ():
            for token, logprob in (entry or {}).items():
                logprob.decoded_token = self.tokenizer.decode([token])
        return entries

    # -- state ---------------------------------------------------------------------------

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()  # a step in flight then holds only dropped tokens

    def stats(self) -> EngineStats:
        blocks = self.scheduler.block_manager
        return EngineStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            1 - blocks.num_free_blocks / blocks.num_blocks,
            None if self.spec_decode is None else replace(self.spec_decode),
        )

    def check_open(self) -> None:
        """Raise if close() was called."""
        if self.model_runner is None:
            raise RuntimeError("this engine is closed; create a new LLM to generate again")

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


def select_loop(config: Config) -> type[StepLoop]:
    """The step loop: synchronous, or a seam's (async scheduling, speculation) when it is on."""
    if config.async_scheduling:
        from nanovllm.engine.overlap import OverlapLoop

        return OverlapLoop
    if config.speculative_config is not None:
        from nanovllm.engine.speculative import SpeculativeLoop

        return SpeculativeLoop
    return SyncLoop


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


def check_ids_in_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """stop_token_ids and logit_bias name tokens of the vocabulary."""
    for name in ("stop_token_ids", "logit_bias"):
        if bad := [t for t in getattr(params, name) if t >= vocab_size]:
            raise ValueError(
                f"{name}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})"
            )


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
