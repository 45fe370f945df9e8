"""`speculative_config`, vLLM's shape: a dict (or its JSON text, as the server's and bench.py's
`--speculative-config` take it) such as

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}

Only the n-gram method exists here: drafts are looked up in the sequence's own tokens, so no
second model is loaded. As in vLLM, a missing prompt_lookup_min or _max takes the other's value,
and both default to 5."""

import json
from dataclasses import dataclass, fields

from nanovllm.distributed import launched_by_torchrun
from nanovllm.utils import check_choice, check_int

METHODS = ("ngram",)
DEFAULT_LOOKUP = 5  # vLLM's, when neither prompt_lookup_min nor _max is given


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int  # k: the most drafts a row verifies per step
    method: str = "ngram"
    prompt_lookup_min: int = DEFAULT_LOOKUP  # the shortest n-gram that may match
    prompt_lookup_max: int = DEFAULT_LOOKUP  # the longest n-gram tried first

    def __post_init__(self) -> None:
        check_choice("speculative_config: method", self.method, METHODS)
        check_int("speculative_config: num_speculative_tokens", self.num_speculative_tokens, 1)
        check_int("speculative_config: prompt_lookup_min", self.prompt_lookup_min, 1)
        check_int("speculative_config: prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )


def parse_speculative_config(value: object, async_scheduling: bool) -> SpeculativeConfig:
    """A SpeculativeConfig from a dict, its JSON text or a SpeculativeConfig; unknown or missing
    keys and bad values are a ValueError (TypeError for a wrong type) naming the key. Refused
    beside async scheduling (one alternative step loop at a time) and under torchrun (each
    rank would have to gather rank 0's verified tokens)."""
    if async_scheduling:
        raise ValueError("speculative_config cannot be combined with async_scheduling=True")
    if launched_by_torchrun():
        raise ValueError("speculative_config is not supported in a process torchrun started")
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise TypeError(f"speculative_config must be a dict or JSON text, got {type(value)}")
    known = {f.name for f in fields(SpeculativeConfig)}
    if unknown := sorted(set(value) - known):
        raise ValueError(
            f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"it accepts {', '.join(sorted(known))}"
        )
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    value = dict(value)
    low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    value["prompt_lookup_min"] = low if low is not None else (high or DEFAULT_LOOKUP)
    value["prompt_lookup_max"] = high if high is not None else (low or DEFAULT_LOOKUP)
    return SpeculativeConfig(**value)
