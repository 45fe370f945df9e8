"""vLLM's StructuredOutputsParams: one constraint on a request's output, set as
`SamplingParams(structured_outputs=...)`. Pure Python (no xgrammar here): the SamplingParams that
carries it is read by the control plane and pickled to data-parallel replicas."""

import json as jsonlib
from dataclasses import dataclass

from nanovllm.utils import check_bool, check_int

# The kinds of constraint, in vLLM's order; a request sets exactly one.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's fields; docs/structured_output.md has each in full)."""

    json: str | dict | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # an EBNF grammar (GBNF, as llama.cpp's), its rule `root`
    json_object: bool | None = None  # True: any JSON object
    disable_any_whitespace: bool = False  # JSON without whitespace between its tokens
    disable_additional_properties: bool = False  # always so here: xgrammar's strict mode
    whitespace_pattern: str | None = None  # vLLM's outlines option: refused
    structural_tag: str | None = None  # vLLM's: refused (not implemented here)
    # A reasoning model's end of thinking (Qwen3's `</think>` id): the constraint holds what
    # follows the output's first such token, and nothing before it. None: the whole output.
    reasoning_end_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"structured_outputs.{name} is not supported")
        check_bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        check_bool(
            "structured_outputs.disable_additional_properties", self.disable_additional_properties
        )
        if self.reasoning_end_token_id is not None:
            check_int("structured_outputs.reasoning_end_token_id", self.reasoning_end_token_id, 0)
        given = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs takes exactly one of {', '.join(KINDS)}; "
                f"got {', '.join(given) if given else 'none'}"
            )
        self._check_types()

    def _check_types(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError(
                f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                f"got {type(self.json).__name__}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"structured_outputs.{name} must be a string, got {type(value).__name__}"
                )
        choice = self.choice
        if choice is not None:
            if not isinstance(choice, (list, tuple)) or not all(isinstance(c, str) for c in choice):
                raise TypeError(
                    f"structured_outputs.choice must be a list of strings, got {choice!r:.80}"
                )
            if not choice:
                raise ValueError("structured_outputs.choice must hold at least one string")
            self.choice = list(choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(
                f"structured_outputs.json_object must be True (or None), got {self.json_object!r}"
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    def key(self) -> tuple:
        """What its compiled grammar depends on: equal keys, one grammar (the cache's key). A
        schema's properties keep their order: the grammar follows it. Where the grammar starts
        (reasoning_end_token_id) is the matcher's business, not the grammar's."""
        kind = self.kind
        spec = getattr(self, kind)
        if kind == "json" and isinstance(spec, dict):
            spec = jsonlib.dumps(spec)
        elif kind == "choice":
            spec = tuple(spec)
        whitespace = self.disable_any_whitespace and kind in ("json", "json_object")
        return kind, spec, whitespace
