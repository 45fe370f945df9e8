"""Checks user requests before anything is queued, so one bad prompt in a list rejects
the whole call and leaves the engine exactly as it was."""
from numbers import Integral

from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]


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


def as_params_list(sampling_params: object, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(sampling_params).__name__}")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"got {len(sampling_params)} sampling params for {num_prompts} prompts; "
                         "pass one SamplingParams for all, or exactly one per prompt")
    for i, params in enumerate(sampling_params):
        check_params(params, i)
    return list(sampling_params)


def check_params(params: object, index: int | None = None) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{_where(index)}sampling params must be a SamplingParams, got "
                        f"{type(params).__name__}")
    return params


def check_token_ids(token_ids: object, vocab_size: int, index: int | None = None) -> list[int]:
    """A prompt's token ids as a list of ints in [0, vocab_size)."""
    if not isinstance(token_ids, (list, tuple)):
        raise TypeError(f"{_where(index)}a prompt must be a string or a list of token ids, "
                        f"got {type(token_ids).__name__}")
    if not token_ids:
        raise ValueError(f"{_where(index)}the prompt is empty; give at least one token")
    for token in token_ids:
        if isinstance(token, bool) or not isinstance(token, Integral):
            raise TypeError(f"{_where(index)}token ids must be ints, got "
                            f"{type(token).__name__} ({token!r})")
        if not 0 <= token < vocab_size:
            raise ValueError(f"{_where(index)}token id {token} is outside the model's vocabulary "
                             f"[0, {vocab_size})")
    return [int(t) for t in token_ids]


def _where(index: int | None) -> str:
    return "" if index is None else f"prompt {index}: "
