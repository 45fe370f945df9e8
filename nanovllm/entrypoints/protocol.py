"""OpenAI's API in plain dicts, the requests' side: a request body -> prompts and
SamplingParams (responses.py has the other side), and the error body.

Shapes are those of OpenAI's API reference (the `openai` client's types), with vLLM's extras:
sampling fields OpenAI lacks (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `stop_token_ids`, ...). A bad value raises TypeError / ValueError whose message
begins with the field's name (SamplingParams' own checks included); the server answers those
with 400.
"""

import json
import re
from numbers import Integral

from nanovllm.entrypoints import structured
from nanovllm.entrypoints.tools import template_messages
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
UNSUPPORTED_FIELDS = ("suffix", "functions", "prompt_logprobs")


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as e:  # bad JSON or bad UTF-8
        raise ValueError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise TypeError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_fields(body: dict, chat: bool) -> None:
    """Fields that every request checks the same way."""
    for name in UNSUPPORTED_FIELDS:
        if body.get(name):
            raise ValueError(f"{name} is not supported by this server")
    if body.get("stream") is not None:
        check_bool("stream", body["stream"])
    if echo(body) and (chat or body.get("stream")):
        raise ValueError(
            "echo is supported on /v1/completions without stream (as lm-eval and other "
            "evaluation harnesses send it)"
        )


def echo(body: dict) -> bool:
    """Completions' echo: the prompt (its text, and with logprobs its tokens' logprobs, the
    first None) before the completion in each choice."""
    return body.get("echo") is not None and check_bool("echo", body["echo"])


def echo_only(body: dict) -> bool:
    """echo with max_tokens 0: the prompt and no completion (how lm-eval scores a text)."""
    return echo(body) and type(body.get("max_tokens")) is int and body["max_tokens"] == 0


def include_usage(body: dict) -> bool:
    """stream_options.include_usage: a last chunk with the usage (streaming only)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not body.get("stream"):
        raise ValueError("stream_options must be an object, and only with stream: true")
    return check_bool("stream_options.include_usage", options.get("include_usage", False))


def sampling_params(
    body: dict, chat: bool, max_model_len: int, max_logprobs: int
) -> SamplingParams:
    """The request's SamplingParams. max_tokens defaults as in vLLM: 16 for completions,
    up to max_model_len for chat. Chat's logprobs is a bool with top_logprobs beside it.
    With echo, the prompt's logprobs are asked as many as the completion's."""
    kwargs = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    kwargs["structured_outputs"] = structured.structured_outputs(body, chat)  # None: free
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = logit_bias(body["logit_bias"])
    if not chat:
        kwargs.setdefault("max_tokens", 16)
        if body.get("logprobs") is not None:
            kwargs["logprobs"] = check_logprobs("logprobs", body["logprobs"], max_logprobs)
        if echo(body):
            kwargs["prompt_logprobs"] = kwargs.get("logprobs")
        if echo_only(body):
            # The engine computes a prompt's logprobs as it computes the prompt, which a
            # request does only to generate: it generates one token, which the response
            # leaves out (vLLM does the same).
            kwargs["max_tokens"] = 1
    else:
        if body.get("max_completion_tokens") is not None:
            kwargs.setdefault(
                "max_tokens",
                check_int("max_completion_tokens", body["max_completion_tokens"], minimum=1),
            )
        top = body.get("top_logprobs")
        if top is not None:
            check_logprobs("top_logprobs", top, max_logprobs)
        if check_bool("logprobs", body.get("logprobs") or False):
            kwargs["logprobs"] = top or 0
        elif top:
            raise ValueError("top_logprobs needs logprobs: true")
    named = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    check_max_tokens(kwargs.get("max_tokens"), max_model_len, named)
    return SamplingParams(**kwargs)


def check_logprobs(name: str, value: object, max_logprobs: int) -> int:
    """vLLM's cap: a request's logprobs (each a dict per token) at most max_logprobs."""
    if check_int(name, value, minimum=0) > max_logprobs:
        raise ValueError(
            f"{name}={value} is more than max_logprobs={max_logprobs}, this server's limit "
            f"(the engine's max_logprobs)"
        )
    return value


def check_max_tokens(max_tokens: object, max_model_len: int, name: str) -> None:
    """More completion tokens than the context holds are refused, in vLLM's words (fewer are
    accepted, prompt or not: generation stops at max_model_len tokens in all)."""
    if type(max_tokens) is int and max_tokens > max_model_len:
        raise ValueError(
            f"{name}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens."
        )


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
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise TypeError(
            "prompt must be a string, a list of token ids, or a non-empty list of those"
        )
    for item in prompt:
        if not isinstance(item, str) and not _is_token_ids(item):
            raise TypeError(
                f"prompt must be a string, a list of token ids, or a list of "
                f"those; it holds a {type(item).__name__}"
            )
    return list(prompt)


def _is_token_ids(prompt: object) -> bool:
    """A list that begins with a number is meant as token ids (each is checked with the
    prompt, off the event loop: a list can be long)."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and isinstance(prompt[0], (Integral, float))
        and not isinstance(prompt[0], bool)
    )


def chat_messages(messages: object) -> list[dict]:
    """The conversation as {"role", "content": str} dicts (text content parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise TypeError("messages must be a non-empty list of {'role', 'content'} objects")
    return [
        {
            "role": _role(m),
            "content": _text_content(m.get("content")),
            **template_messages(m),
            **_reasoning(m),
        }
        for m in messages
    ]


def chat_template_kwargs(value: object, reserved: frozenset[str]) -> dict:
    """The request's chat_template_kwargs: more variables for the chat template (Qwen3's
    `enable_thinking`), as vLLM takes them. Those the server sets itself (the messages, the
    tools, the generation prompt, the template, tokenizing) are refused, not overridden."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(
            f"chat_template_kwargs must be an object of template variables, e.g. "
            f'{{"enable_thinking": false}}; got {type(value).__name__}'
        )
    if taken := sorted(set(value) & reserved):
        raise ValueError(
            f"chat_template_kwargs may not set {', '.join(taken)}: the server sets it from the "
            f"request's own fields"
        )
    return value


def _role(message: object) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise TypeError(
            f"messages must hold {{'role': str, 'content': ...}} objects, got {message!r:.80}"
        )
    return message["role"]


def _reasoning(message: dict) -> dict:
    """An earlier reply's thinking, given back (`reasoning_content`, or vLLM's `reasoning`):
    for the chat template, which renders it where the model needs it (Qwen3's keeps the
    thinking of the replies after the last user turn, in a chain of tool calls)."""
    text = message.get("reasoning_content", message.get("reasoning"))
    if text is None:
        return {}
    if not isinstance(text, str):
        raise TypeError(f"messages: reasoning_content must be a string, got {type(text).__name__}")
    return {"reasoning_content": text}


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


class ModelNotFound(LookupError):
    """A 404: the request names a model (or LoRA adapter) that is not served."""

    def __init__(self, message: str, param: str = "model"):
        super().__init__(message)
        self.param = param


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
