"""Small helpers shared by both planes (pure Python). User input is checked with one rule:
TypeError for a wrong type, ValueError for a wrong value, each naming the argument."""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scoped(Generic[T]):
    """A module-level value set only inside `with x.scope(value):`, restored in `finally`."""

    def __init__(self, default: T):
        self.value = default

    @contextmanager
    def scope(self, value: T) -> Iterator[T]:
        previous, self.value = self.value, value
        try:
            yield value
        finally:
            self.value = previous


def check_int(
    name: str, value: object, minimum: int | None = None, maximum: int | None = None
) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_number(
    name: str,
    value: object,
    low: float,
    high: float,
    expected: str,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite number in [low, high] (open ends as asked); `expected` words the error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    # NaN fails every comparison, so it is caught by `not math.isfinite` (as is inf).
    if too_low or too_high or not math.isfinite(value):
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    return value


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {allowed}, got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value
