"""How to pick the next token and when to stop, per request (pure Python: core reads it too)."""

import math
from dataclasses import dataclass

from nanovllm.utils import check_bool, check_int, check_number


@dataclass(slots=True)
class SamplingParams:
    """vLLM's sampling options (docs/api.md's table has each in full). Penalties apply to
    greedy requests too; top_k, top_p, min_p and seed only to sampled ones."""

    temperature: float = 1.0  # 0 (or below 1e-5): greedy; else logits / T
    top_k: int = 0  # keep the k most likely tokens; 0 or -1: off
    top_p: float = 1.0  # keep the most likely tokens until p is reached
    min_p: float = 0.0  # drop tokens below min_p x the top probability
    seed: int | None = None  # per request: the same tokens whatever the batch
    n: int = 1  # completions per prompt (they share its KV blocks)
    max_tokens: int | None = 64  # the most completion tokens; None: up to max_model_len
    min_tokens: int = 0  # no stop token or stop string before this many
    ignore_eos: bool = False  # keep going past EOS
    stop_token_ids: list[int] | None = None  # end the sequence (kept in token_ids)
    stop: str | list[str] | None = None  # end the sequence; the text ends before
    repetition_penalty: float = 1.0  # prompt and completion tokens: logit / or x it
    presence_penalty: float = 0.0  # minus this for each token in the completion
    frequency_penalty: float = 0.0  # minus this per occurrence in the completion
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (greedy too)
    logprobs: int | None = None  # per completion token: the top this many, + the chosen
    prompt_logprobs: int | None = None  # the same for each prompt token (the first: None)
    include_stop_str_in_output: bool = False  # keep the stop string (or token) in the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    structured_outputs: object = None  # a StructuredOutputsParams (structured/): one constraint

    def __post_init__(self) -> None:
        check_number("temperature", self.temperature, 0, math.inf, "a number >= 0 (0 means greedy)")
        check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 or -1 to turn it off; got {self.top_k}")
        check_number("top_p", self.top_p, 0, 1, "in (0, 1] (1 turns it off)", low_open=True)
        check_number("min_p", self.min_p, 0, 1, "in [0, 1) (0 turns it off)", high_open=True)
        for name, minimum in (
            ("seed", None),
            ("max_tokens", 1),
            ("logprobs", 0),
            ("prompt_logprobs", 0),
        ):  # None turns these off
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum)
        check_int("n", self.n, minimum=1)
        check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        check_number(
            "repetition_penalty",
            self.repetition_penalty,
            0,
            math.inf,
            "a number > 0 (1 turns it off)",
            low_open=True,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            check_number(name, getattr(self, name), -2, 2, "in [-2, 2] (0 turns it off)")
        bias = {} if self.logit_bias is None else self.logit_bias
        if not isinstance(bias, dict):
            raise TypeError(f"logit_bias must be a dict (id -> bias), got {type(bias).__name__}")
        self.logit_bias = {
            check_int("logit_bias's token ids", i, minimum=0): float(
                check_number(f"logit_bias[{i}]", b, -math.inf, math.inf, "finite")
            )
            for i, b in bias.items()
        }
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            check_bool(name, getattr(self, name))
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"stop_token_ids must be a list of token ids, got {type(ids).__name__}")
        self.stop_token_ids = [check_int("stop_token_ids", i, minimum=0) for i in ids]
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not all(stop):
            raise ValueError("stop must not contain an empty string")
        self.stop = list(stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5  # vLLM's _SAMPLING_EPS: dividing by less would overflow

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )
