"""OpenAI's API in plain dicts: a request body -> prompts and SamplingParams, Deltas ->
the response objects of /v1/completions and /v1/chat/completions (streamed or whole).

Shapes are those of OpenAI's API reference (the `openai` client's types), with vLLM's
extras: `stop_reason` on a choice and sampling fields OpenAI lacks (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, ...). A bad value
raises TypeError / ValueError naming the field (SamplingParams' own checks included); the
server answers those with 400.
"""

import json
import re
import time
import uuid
from numbers import Integral

from nanovllm.engine.async_engine import Delta
from nanovllm.entrypoints import structured
from nanovllm.entrypoints.tools import template_messages
from nanovllm.outputs import Logprob
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils import check_bool, check_int, check_number

# Request fields that are SamplingParams fields of the same name and meaning.
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "max_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
)
# OpenAI fields this server does not implement: refused when set rather than ignored.
UNSUPPORTED_FIELDS = ("suffix", "echo", "functions", "prompt_logprobs")
MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as e:  # bad JSON or bad UTF-8
        raise ValueError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise TypeError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_fields(body: dict) -> None:
    """Fields that every request checks the same way."""
    for name in UNSUPPORTED_FIELDS:
        if body.get(name):
            raise ValueError(f"{name} is not supported by this server")
    if body.get("stream") is not None:
        check_bool("stream", body["stream"])


def include_usage(body: dict) -> bool:
    """stream_options.include_usage: a last chunk with the usage (streaming only)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not body.get("stream"):
        raise ValueError("stream_options must be an object, and only with stream: true")
    return check_bool("stream_options.include_usage", options.get("include_usage", False))


def sampling_params(body: dict, chat: bool) -> SamplingParams:
    """The request's SamplingParams. max_tokens defaults as in vLLM: 16 for completions,
    up to max_model_len for chat. Chat's logprobs is a bool with top_logprobs beside it."""
    kwargs = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    kwargs["structured_outputs"] = structured.structured_outputs(body, chat)  # None: free
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = logit_bias(body["logit_bias"])
    if not chat:
        kwargs.setdefault("max_tokens", 16)
        if body.get("logprobs") is not None:
            kwargs["logprobs"] = body["logprobs"]
    else:
        kwargs.setdefault("max_tokens", body.get("max_completion_tokens"))
        top = body.get("top_logprobs")
        if top is not None:
            check_int("top_logprobs", top, minimum=0, maximum=20)
        if check_bool("logprobs", body.get("logprobs") or False):
            kwargs["logprobs"] = top or 0
        elif top:
            raise ValueError("top_logprobs needs logprobs: true")
    return SamplingParams(**kwargs)


def logit_bias(bias: object) -> dict[int, float]:
    """OpenAI's logit_bias: an object of token ids (JSON keys are strings) -> a bias in
    [-100, 100], added to that token's logit."""
    if not isinstance(bias, dict):
        raise TypeError(
            f"logit_bias must be an object of token id -> bias, got {type(bias).__name__}"
        )
    if bad := [key for key in bias if not re.fullmatch("[0-9]+", key)]:
        raise ValueError(f"logit_bias keys must be token ids, got {bad[0]!r}")
    return {
        int(key): check_number(f"logit_bias[{key}]", value, -100, 100, "in [-100, 100]")
        for key, value in bias.items()
    }


def completion_prompts(prompt: object) -> list[str | list[int]]:
    """A completions prompt: a string, token ids, or a list of either (one choice set each)."""
    if isinstance(prompt, str) or (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt)
    ):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise TypeError(
            "prompt must be a string, a list of token ids, or a non-empty list of those"
        )
    for item in prompt:
        if not isinstance(item, (str, list)):
            raise TypeError(
                f"prompt must be a string, a list of token ids, or a list of "
                f"those; it holds a {type(item).__name__}"
            )
    return list(prompt)


def chat_messages(messages: object) -> list[dict]:
    """The conversation as {"role", "content": str} dicts (text content parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise TypeError("messages must be a non-empty list of {'role', 'content'} objects")
    return [
        {"role": _role(m), "content": _text_content(m.get("content")), **template_messages(m)}
        for m in messages
    ]


def _role(message: object) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise TypeError(
            f"messages must hold {{'role': str, 'content': ...}} objects, got {message!r:.80}"
        )
    return message["role"]


def _text_content(content: object) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(part["text"] for part in content)
    raise ValueError(
        "a message's content must be a string or a list of text parts "
        "({'type': 'text', 'text': ...}); other parts are not supported"
    )


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def param_of(message: str, body: dict) -> str | None:
    """The field an error message names first: SamplingParams' messages begin with it, the
    engine's with "prompt N: " and then the field, unless the prompt itself is at fault."""
    named = re.match(r"(?:prompt \d+: )?(\w*)", message)[1]
    if named == "structured_outputs":  # the engine's name, for what the body may call otherwise
        named = structured.source(body)
    if named in body:
        return named
    return "prompt" if message.startswith("prompt") and "prompt" in body else None


# -- responses ----------------------------------------------------------------------------


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


def completion_choice(delta: Delta, top_k: int | None) -> dict:
    return {
        "index": delta.index,
        "text": delta.text,
        "logprobs": None if top_k is None else completion_logprobs(delta, top_k),
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


def completion_logprobs(delta: Delta, top_k: int) -> dict:
    """The legacy completions shape: parallel lists over the tokens."""
    chosen = [entry[token] for token, entry in zip(delta.token_ids, delta.logprobs)]
    return {
        "tokens": [lp.decoded_token for lp in chosen],
        "token_logprobs": [max(lp.logprob, MIN_LOGPROB) for lp in chosen],
        "top_logprobs": [
            {lp.decoded_token: max(lp.logprob, MIN_LOGPROB) for lp in _top(entry, top_k)}
            for entry in delta.logprobs
        ],
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
