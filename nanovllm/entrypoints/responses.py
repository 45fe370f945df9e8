"""OpenAI's API in plain dicts, the responses' side: Deltas -> the objects of /v1/completions
and /v1/chat/completions, streamed or whole, with vLLM's `stop_reason` on each choice; an
echoed prompt before a completion (echo), and the legacy completions logprobs with
`text_offset`."""

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple, TypeVar

from nanovllm.engine.async_engine import Delta
from nanovllm.outputs import Logprob

State = TypeVar("State")

MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)
Decode = Callable[[int], str]  # a token id -> its text


class ResponseHead:
    """What every object of one response shares: id, object, created, model."""

    def __init__(self, prefix: str, obj: str, model: str):
        self.fields = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": obj,
            "created": int(time.time()),
            "model": model,
        }

    def __call__(self, **rest: object) -> dict:
        return {**self.fields, **rest}


class Echoed(NamedTuple):
    """The prompts of a request with echo, each repeated before its choices: its text as sent
    (None: token ids, which `decode` gives the text of, special tokens included, as vLLM),
    its ids and, if asked, its tokens' logprobs; without their completions if not
    keep_completion (max_tokens 0)."""

    texts: list[str | None]
    token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob] | None] | None]
    keep_completion: bool
    decode: Callable[[list[int]], str]


def whole(
    head: "ResponseHead",
    choice: Callable[..., dict],
    deltas: list[Delta],
    num_choices: int,
    prompt_token_ids: list[list[int]],
    echo: Echoed | None,
) -> bytes:
    """A whole (non-streamed) response's JSON: the Deltas merged into one per choice, each
    after its prompt if echoed; the usage counts the completion tokens returned."""
    choices = merge(deltas, num_choices)
    num_tokens = sum(len(d.token_ids) for d in choices)
    if echo is not None:
        per_prompt = num_choices // len(prompt_token_ids)
        choices = [echoed(d, echo, d.index // per_prompt) for d in choices]
        choice = functools.partial(choice, decode=lambda token: echo.decode([token]))
        num_tokens = num_tokens if echo.keep_completion else 0
    response = head(choices=[choice(d) for d in choices], usage=usage(prompt_token_ids, num_tokens))
    return json.dumps(response).encode()


def usage(prompt_token_ids: list[list[int]], num_completion_tokens: int) -> dict:
    prompt_tokens = sum(map(len, prompt_token_ids))  # each prompt once, whatever n is
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": prompt_tokens + num_completion_tokens,
    }


def merge(deltas: list[Delta], num_choices: int) -> list[Delta]:
    """One Delta per choice holding all of its output, in index order."""
    merged = [Delta(i, "", [], None) for i in range(num_choices)]
    for delta in deltas:
        whole = merged[delta.index]
        whole.text += delta.text
        whole.token_ids += delta.token_ids
        if delta.logprobs is not None:
            whole.logprobs = (whole.logprobs or []) + delta.logprobs
        whole.finish_reason, whole.stop_reason = delta.finish_reason, delta.stop_reason
    return merged


def echoed(delta: Delta, echo: Echoed, prompt: int) -> Delta:
    """A whole choice with its prompt before it: text, token ids and, if asked, logprobs
    (the prompt's first entry None); the prompt alone if not echo.keep_completion."""
    if not echo.keep_completion:
        delta = Delta(delta.index, "", [], None if delta.logprobs is None else [], "length")
    ids, text = echo.token_ids[prompt], echo.texts[prompt]
    text = echo.decode(ids) if text is None else text
    logprobs = None if delta.logprobs is None else [*echo.logprobs[prompt], *delta.logprobs]
    return Delta(
        delta.index,
        text + delta.text,
        [*ids, *delta.token_ids],
        logprobs,
        delta.finish_reason,
        delta.stop_reason,
    )


def completion_choice(
    delta: Delta, top_k: int | None, text_offset: int = 0, decode: Decode | None = None
) -> dict:
    return {
        "index": delta.index,
        "text": delta.text,
        "logprobs": None
        if top_k is None
        else completion_logprobs(delta, top_k, text_offset, decode),
        "finish_reason": delta.finish_reason,
        "stop_reason": delta.stop_reason,
    }


def chat_choice(delta: Delta, top_k: int | None, streamed: bool) -> dict:
    message = {"content": delta.text} if streamed else {"role": "assistant", "content": delta.text}
    return {
        "index": delta.index,
        "delta" if streamed else "message": message,
        "logprobs": None if top_k is None else chat_logprobs(delta, top_k),
        "finish_reason": delta.finish_reason,
        "stop_reason": delta.stop_reason,
    }


def completion_logprobs(
    delta: Delta, top_k: int, text_offset: int = 0, decode: Decode | None = None
) -> dict:
    """The legacy completions shape, parallel lists over the tokens: each token's text and
    logprob, its top_k alternatives and itself (OpenAI's "up to logprobs + 1"), and where its
    text begins (text_offset: `text_offset` plus the lengths of the tokens before it, as
    vLLM counts). An echoed prompt's first token has no entry: its logprob and top are None
    and `decode` gives its text."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, entry in zip(delta.token_ids, delta.logprobs):
        if entry is None:
            text, logprob, top = decode(token), None, None
        else:
            chosen = entry[token]
            text, logprob = chosen.decoded_token, max(chosen.logprob, MIN_LOGPROB)
            top = {
                lp.decoded_token: max(lp.logprob, MIN_LOGPROB)
                for lp in (chosen, *_top(entry, top_k))
            }
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(delta: Delta, top_k: int) -> dict:
    """The chat shape: per token, itself and its top_k alternatives."""
    return {
        "content": [
            dict(
                _token_logprob(entry[token]),
                top_logprobs=[_token_logprob(lp) for lp in _top(entry, top_k)],
            )
            for token, entry in zip(delta.token_ids, delta.logprobs)
        ]
    }


def _token_logprob(logprob: Logprob) -> dict:
    token = logprob.decoded_token
    return {
        "token": token,
        "logprob": max(logprob.logprob, MIN_LOGPROB),
        "bytes": list(token.encode("utf-8")),
    }


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    """The entry's k most likely tokens, most likely first (the chosen one may be extra)."""
    return sorted(
        (lp for lp in entry.values() if lp.rank is not None and lp.rank <= k),
        key=lambda lp: lp.rank,
    )


async def with_choice_state(
    chunks: AsyncIterator[dict], new_state: Callable[[], State]
) -> AsyncIterator[tuple[dict, State | None]]:
    """A chat stream's chunks, each with its choice's state (made by new_state() at the choice's
    first text): what rewrites a stream choice by choice (reasoning.py, tools.py) reads it. A
    choice's opening chunk (its role) and the usage chunk come with None: they pass as they are."""
    states: dict[int, State] = {}
    async for chunk in chunks:
        choices = chunk.get("choices")
        if not choices or "role" in choices[0]["delta"]:
            yield chunk, None
        else:
            yield chunk, states.setdefault(choices[0]["index"], new_state())
