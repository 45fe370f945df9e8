"""How to pick the next token and when to stop: one `SamplingParams` per request.

Pure Python (no torch): the control plane reads these fields too.
"""
from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    """vLLM's names and meanings.

    temperature: 0 means greedy (argmax); > 0 divides the logits before sampling.
    max_tokens:  the most completion tokens to generate.
    ignore_eos:  keep generating past the end-of-sequence token.
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise TypeError(f"max_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a number, got NaN")
