"""Structured outputs (imported only when a request has `structured_outputs`): its output is
held to a JSON schema, a regex, a choice of strings or an EBNF grammar by xgrammar.

    make_request ─ prepare(): check, compile once per distinct constraint (grammars.py's cache)
    each step    ─ the sampling metadata builder: GrammarMatchers.build() advances each
                   constrained sequence's matcher by its new tokens and fills its row of the
                   token bitmask (matchers.py); the sampler sets what it forbids to -inf
    the end      ─ EOS is allowed only where the grammar may end, so the scheduler's stop
                   tokens end a sequence whose grammar is complete: nothing else decides

`StructuredOutputsParams` is pure Python; xgrammar is imported with the first constrained
request (an optional dependency: `pip install nano-vllm[structured]`)."""

import threading
from typing import TYPE_CHECKING

from nanovllm.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from nanovllm.engine.llm_engine import LLMEngine
    from nanovllm.sampling_params import SamplingParams

__all__ = ["StructuredOutputsParams", "prepare"]

_SETUP = threading.Lock()  # prepare() may run off the engine thread (the server's)


def prepare(engine: "LLMEngine", params: "SamplingParams") -> None:
    """Check a request's structured_outputs and compile its grammar, before it is queued: a
    bad constraint is a ValueError naming it. Compiled once per distinct constraint (a cache);
    thread-safe, so the server compiles off the engine thread."""
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
    vocab_size = engine.config.hf_config.vocab_size
    if not any(t < vocab_size for t in (*engine.eos_token_ids, *params.stop_token_ids)):
        raise ValueError(
            "structured_outputs needs a token to end the output on: the model has no EOS "
            "token in its vocabulary, so give stop_token_ids"
        )
    builder = engine.model_runner.sampling_metadata
    with _SETUP:
        if builder.grammars is None:
            from nanovllm.structured.grammars import Grammars
            from nanovllm.structured.matchers import GrammarMatchers

            grammars = Grammars(engine.tokenizer, vocab_size)
            builder.grammars = GrammarMatchers(grammars, builder.device)
    builder.grammars.grammars.compile(constraint)
