"""Compiled grammars, one per distinct constraint: xgrammar's GrammarCompiler over the engine's
tokenizer, behind a cache keyed by StructuredOutputsParams.key(). Compiling works out, for
every token of the vocabulary, where in the grammar it may come (xgrammar's token mask cache):
milliseconds for a small vocabulary, more for a real one, so it is done once, before a
request is queued, and never in a step. Thread-safe: a second request for a constraint being
compiled waits for that compilation instead of starting its own."""

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future

from transformers import PreTrainedTokenizerBase

from nanovllm.structured.params import StructuredOutputsParams

MAX_CACHED = 256  # compiled grammars kept, the least recently used dropped first
# Whitespace allowed between two tokens of JSON: a model cannot loop on it (llama.cpp bounds it
# too), and pretty-printed JSON nested 15 deep with an indent of 2 fits.
MAX_WHITESPACE = 32
# xgrammar 0.2.9's character of a length-bounded JSON string, and JSON's (no control character).
BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
JSON_STRING_CHAR = r"[^\"\\\0-\x1f]"
# Schema keywords whose value maps names to schemas, and those whose value is data.
NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
VALUES = ("enum", "const", "default", "examples", "required", "dependentRequired")


def import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError(
            "structured outputs need xgrammar: pip install 'nano-vllm[structured]' "
            "(or pip install xgrammar)"
        ) from None
    return xgrammar


class Grammars:
    """The compiled grammar of each constraint, compiled on first use."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int):
        """`vocab_size`: the model's (its logits' width), which may exceed the tokenizer's."""
        self.xgr = import_xgrammar()
        self.tokenizer_info = tokenizer_info(self.xgr, tokenizer, vocab_size)
        self.compiler = self.xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self.lock = threading.Lock()
        self.cache: OrderedDict[tuple, Future] = OrderedDict()

    def compile(self, params: StructuredOutputsParams):
        """The xgrammar CompiledGrammar of `params`; a ValueError naming the field if it is
        invalid (an invalid constraint is not cached: its error is raised again)."""
        key = params.key()
        with self.lock:
            future = self.cache.get(key)
            owner = future is None
            if owner:
                future = self.cache[key] = Future()
                while len(self.cache) > MAX_CACHED:
                    self.cache.popitem(last=False)
            else:
                self.cache.move_to_end(key)
        if owner:
            try:
                future.set_result(self._compile(params))
            except BaseException as e:
                with self.lock:
                    self.cache.pop(key, None)
                future.set_exception(e)
        return future.result()

    def _compile(self, params: StructuredOutputsParams):
        kind, spec = params.kind, getattr(params, params.kind)
        try:
            if kind == "json":
                return self._compile_json(schema(spec), params.disable_any_whitespace)
            if kind == "json_object":
                return self._compile_json({"type": "object"}, params.disable_any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(spec))
            return self.compiler.compile_grammar(spec)
        except RuntimeError as e:  # xgrammar's parsers refuse with a RuntimeError
            raise ValueError(
                f"structured_outputs.{kind} is invalid: {xgrammar_message(e)}"
            ) from None

    def _compile_json(self, schema: dict, disable_any_whitespace: bool):
        """xgrammar's grammar of the schema, in strict mode (its default: no properties or
        items beyond the schema's), with at most MAX_WHITESPACE whitespace characters between
        two tokens of JSON, or none. Its length-bounded strings (maxLength) let raw control
        characters in, which JSON forbids: their character class is the JSON string's here."""
        if disable_any_whitespace:
            options = dict(any_whitespace=False, separators=(",", ":"))
        else:
            options = dict(any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE)
        grammar = self.xgr.Grammar.from_json_schema(json.dumps(schema), **options)
        ebnf = str(grammar).replace(BOUNDED_STRING_CHAR, JSON_STRING_CHAR)
        return self.compiler.compile_grammar(ebnf)


def tokenizer_info(xgr, tokenizer: PreTrainedTokenizerBase, vocab_size: int):
    """xgrammar's view of the vocabulary: each token's bytes, with the special tokens (the
    chat template's markers, EOS) left empty, which xgrammar never lets a grammar use: they
    are not text (skip_special_tokens drops them from it). EOS is allowed by its id, as a
    matcher's stop token. Ids past the tokenizer's, up to the model's vocab_size, are never
    allowed."""
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    encoded = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size:
            encoded[i] = token
    for i, added in tokenizer.added_tokens_decoder.items():
        if added.special and i < vocab_size:
            encoded[i] = ""
    return xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=detected.stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )


def schema(spec: str | dict) -> dict:
    """A JSON schema given as a dict or as its JSON text."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(
            f"structured_outputs.json must be a JSON schema object, got {type(spec).__name__}"
        )
    if (keyword := unenforced(spec)) is not None:
        raise ValueError(
            f"structured_outputs.json uses {keyword}, which xgrammar accepts but does not "
            f"enforce: an output could break the schema"
        )
    return spec


def unenforced(schema: object) -> str | None:
    """A keyword of the schema that xgrammar 0.2.9 ignores: `not`, `if` (with then / else), an
    `allOf` of several schemas. The names in `properties` and the like, and the values in
    `enum`, `const` and the like, are not keywords."""
    if isinstance(schema, list):
        return next(filter(None, map(unenforced, schema)), None)
    if not isinstance(schema, dict):
        return None
    if "not" in schema or "if" in schema:
        return "not" if "not" in schema else "if"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "an allOf of several schemas"
    for key, value in schema.items():
        if key in NAMED_SCHEMAS and isinstance(value, dict):
            value = list(value.values())
        elif key in VALUES:
            continue
        if (found := unenforced(value)) is not None:
            return found
    return None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    return "root ::= " + " | ".join(f'"{ebnf_escape(c)}"' for c in choices)


def ebnf_escape(text: str) -> str:
    """`text` inside an EBNF string literal: quotes, backslashes and control characters
    escaped (\\uXXXX where EBNF has no shorter escape)."""
    short = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return "".join(
        short.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in text
    )


def xgrammar_message(error: RuntimeError) -> str:
    """xgrammar's error without its "[time] file.cc:line: " prefix."""
    text = str(error).strip()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
