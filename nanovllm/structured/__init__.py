"""Structured outputs (imported only when a request has `structured_outputs`): its output is
held to a JSON schema, a regex, a choice of strings or an EBNF grammar by xgrammar.

    make_request ─ check_request(), then StructuredOutputs.compile(): once per distinct
                   constraint (grammars.py's cache)
    each step    ─ the sampler's logits hook: GrammarMatchers.build() advances each constrained
                   sequence's matcher by its new tokens and fills its row of the token bitmask
                   (matchers.py); the sampler sets what it forbids to -inf
    the end      ─ EOS is allowed only where the grammar may end, so the scheduler's stop
                   tokens end a sequence whose grammar is complete: nothing else decides

With `reasoning_end_token_id` (a reasoning model's `</think>`), a sequence samples freely until
it has taken that token, and its grammar holds what follows (vLLM's reasoning_ended).

`StructuredOutputsParams` is pure Python; xgrammar is imported with the first constrained
request (an optional dependency: `pip install nano-vllm[structured]`)."""

import threading
from typing import TYPE_CHECKING

from nanovllm.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from nanovllm.sampling_params import SamplingParams

__all__ = ["StructuredOutputs", "StructuredOutputsParams", "check_request"]


def check_request(params: "SamplingParams", eos_token_ids: set[int], vocab_size: int) -> None:
    """A request's structured_outputs and what it may be combined with, before it is queued."""
    constraint = params.structured_outputs
    if not isinstance(constraint, StructuredOutputsParams):
        raise TypeError(
            f"structured_outputs must be a StructuredOutputsParams, got {type(constraint).__name__}"
        )
    if params.ignore_eos or params.min_tokens:
        raise ValueError(
            "structured_outputs cannot be combined with ignore_eos or min_tokens: the grammar "
            "decides where the output may end (EOS is allowed there and only there)"
        )
    end = constraint.reasoning_end_token_id
    if end is not None and (end >= vocab_size or end in (*eos_token_ids, *params.stop_token_ids)):
        raise ValueError(
            f"structured_outputs.reasoning_end_token_id={end} must be a token of the model's "
            f"vocabulary (< {vocab_size}) that does not end the output"
        )
    if not any(t < vocab_size for t in (*eos_token_ids, *params.stop_token_ids)):
        raise ValueError(
            "structured_outputs needs a token to end the output on: the model has no EOS "
            "token in its vocabulary, so give stop_token_ids"
        )


class StructuredOutputs:
    """An engine's structured outputs, made with its first constrained request (under `lock`:
    the server makes requests off the engine thread): the compiled grammars, and the matchers
    that the engine gives the sampler as a logits hook."""

    lock = threading.Lock()

    def __init__(
        self, tokenizer: "PreTrainedTokenizerBase", vocab_size: int, device: "torch.device"
    ):
        from nanovllm.structured.grammars import Grammars
        from nanovllm.structured.matchers import GrammarMatchers

        self.grammars = Grammars(tokenizer, vocab_size)
        self.matchers = GrammarMatchers(self.grammars, device)

    def compile(self, constraint: StructuredOutputsParams) -> None:
        """Compile a constraint now (once per distinct one: a cache), not in a step; a
        ValueError naming the field if it is invalid. Thread-safe."""
        self.grammars.compile(constraint)
