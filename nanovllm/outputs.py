"""What generation returns, in vLLM's shapes; a RequestOutput is also nano-vLLM's dict, a Mapping
of "text" and "token_ids" (and it answers out["finish_reason"]): those of its first completion."""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """A token's log-probability in the model's raw distribution and its rank there (1 = top)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # without the stop string / stop token unless include_stop_str_in_output
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per token: the top k + the chosen one
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or token id (None: EOS or length)
    seq_id: int = -1  # nano-vLLM's step-by-step API: the id add_request returned

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput(Mapping):
    request_id: str
    prompt: str | None  # None for a token-id prompt
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # the same; the first token's: None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache

    def __getitem__(self, key: str) -> object:
        if key not in ("text", "token_ids", "finish_reason"):
            raise KeyError(key)
        return getattr(self.outputs[0], key)

    def __iter__(self) -> Iterator[str]:  # dict(out) is nano-vLLM's dict
        return iter(("text", "token_ids"))

    def __len__(self) -> int:
        return 2
