"""How to pick the next token and when to stop: one `SamplingParams` per request.

Pure Python (no torch): the control plane reads these fields too. Names, defaults and
meanings are vLLM's; the README's table documents each field.
"""
import math
from dataclasses import dataclass

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by them
# would overflow.
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """vLLM's sampling options. Penalties apply to greedy requests too; top_k, top_p,
    min_p and seed only to sampled ones.

    temperature:        0 (or below 1e-5) means greedy (argmax); otherwise logits / T.
    top_k:              keep the k most likely tokens; 0 or -1 means off.
    top_p:              keep the smallest set of most likely tokens whose probability
                        reaches top_p, the token that crosses it included; 1 means off.
    min_p:              drop tokens less likely than min_p * the top token's probability.
    seed:               per-request random seed: the same seed gives the same tokens
                        whatever else is in the batch.
    max_tokens:         the most completion tokens to generate.
    min_tokens:         EOS and stop_token_ids cannot be sampled, and stop strings do not
                        match, until this many completion tokens exist.
    ignore_eos:         keep generating past the end-of-sequence token.
    stop_token_ids:     token ids that end the sequence (kept in token_ids, not in text).
    stop:               strings that end the sequence; the text ends before them.
    repetition_penalty: > 1 discourages tokens already in the prompt or completion
                        (positive logits divided by it, negative ones multiplied).
    presence_penalty:   subtracted from the logit of every token already in the completion.
    frequency_penalty:  subtracted once per occurrence of a token in the completion.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        self._check_filters()
        self._check_lengths()
        self._check_penalties()
        self.stop_token_ids = _token_id_list("stop_token_ids", self.stop_token_ids)
        self.stop = _stop_string_list(self.stop)
        if self.seed is not None:
            _check_int("seed", self.seed)

    def _check_filters(self) -> None:
        _check_range("temperature", self.temperature, 0, math.inf, "a number >= 0 (0 means greedy)")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 or -1 to turn it off; got {self.top_k}")
        _check_range("top_p", self.top_p, 0, 1, "in (0, 1] (1 turns it off)", low_open=True)
        _check_range("min_p", self.min_p, 0, 1, "in [0, 1) (0 turns it off)", high_open=True)

    def _check_lengths(self) -> None:
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    def _check_penalties(self) -> None:
        _check_range("repetition_penalty", self.repetition_penalty, 0, math.inf,
                     "a number > 0 (1 turns it off)", low_open=True)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_range(name, getattr(self, name), -2, 2, "in [-2, 2] (0 turns it off)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _check_range(name: str, value: object, low: float, high: float, expected: str,
                 low_open: bool = False, high_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    # NaN fails every comparison, so it is caught by `not math.isfinite` (as is inf).
    if too_low or too_high or not math.isfinite(value):
        raise ValueError(f"{name} must be {expected}, got {value}")


def _token_id_list(name: str, value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of token ids, got {type(value).__name__}")
    ids = list(value)
    for token_id in ids:
        _check_int(name, token_id)
        if token_id < 0:
            raise ValueError(f"{name} must hold token ids >= 0, got {token_id}")
    return ids


def _stop_string_list(value: object) -> list[str]:
    if value is None:
        return []
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise TypeError(f"stop must be a string or a list of strings, got {value!r}")
    if any(not s for s in strings):
        raise ValueError("stop must not contain an empty string")
    return list(strings)
