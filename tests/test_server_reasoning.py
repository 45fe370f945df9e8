"""Thinking mode on the server, as the official `openai` client sees it, on a checkpoint that
thinks as Qwen3 does (tests/thinking.py), served with `--reasoning-parser qwen3`: the request's
chat_template_kwargs reach the chat template; the thinking comes back as reasoning_content (and
vLLM's `reasoning`) and the answer as content, streamed or not, each the offline LLM's text cut at
`</think>`; a JSON schema and a forced tool call hold the answer and leave the thinking as it
was without them. Random weights never end their thinking: a bias on `</think>` makes the
seeded sample do so after a few tokens."""

import json
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
from serving import ENGINE, NAME, engine_flags, running_server
from thinking import ANSWER, SEED, THINK_BIAS

from nanovllm import LLM, SamplingParams

USER = [{"role": "user", "content": "Why is the sky blue?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def server(thinking_checkpoint):
    flags = ["--served-model-name", NAME, "--reasoning-parser", "qwen3", *engine_flags(**ENGINE)]
    with running_server(thinking_checkpoint, *flags) as running:
        yield running


@pytest.fixture(scope="module")
def offline(thinking_checkpoint):
    with LLM(str(thinking_checkpoint), **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def end(offline) -> int:
    return offline.tokenizer.convert_tokens_to_ids("</think>")


@pytest.fixture(scope="module")
def client(server):
    with server.client() as client:
        yield client


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def rendered(server, **kwargs) -> str:
    """The prompt the server renders (for USER), as /tokenize and /detokenize give it back."""
    status, tokens = post(server, "/tokenize", {"messages": USER, **kwargs})
    assert status == 200, tokens
    return post(server, "/detokenize", {"tokens": tokens["tokens"]})[1]["prompt"]


def test_chat_template_kwargs_reach_the_template(server, client):
    default = rendered(server)
    off = rendered(server, chat_template_kwargs={"enable_thinking": False})
    assert default.endswith("<|im_start|>assistant\n")
    assert off == default + "<think>\n\n</think>\n\n"
    for kwargs, prompt in (({"enable_thinking": False}, off), ({"enable_thinking": True}, default)):
        reply = client.chat.completions.create(
            model=NAME,
            messages=USER,
            max_tokens=2,
            extra_body={"chat_template_kwargs": kwargs},
        )
        counted = post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False})[1]
        assert reply.usage.prompt_tokens == counted["count"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (["enable_thinking"], "chat_template_kwargs must be an object"),
        ({"tokenize": True}, "chat_template_kwargs may not set tokenize"),
        (
            {"messages": [], "add_generation_prompt": False},
            "may not set add_generation_prompt, messages",
        ),
    ],
)
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=NAME, messages=USER, max_tokens=2, extra_body={"chat_template_kwargs": kwargs}
        )
    assert message in refused.value.body["message"]
    assert refused.value.body["param"] == "chat_template_kwargs"


# -- the thinking apart from the answer ------------------------------------------------------


def thinking(end: int, max_tokens: int = 100, **body) -> dict:
    """A seeded chat request that thinks for a few tokens, then answers."""
    return dict(
        model=NAME,
        messages=USER,
        temperature=1,
        seed=SEED,
        max_tokens=max_tokens,
        logit_bias={str(end): THINK_BIAS},
        **body,
    )


def offline_text(offline, end: int, max_tokens: int = 100, **kwargs) -> str:
    """What the offline LLM writes for the same request, unparsed."""
    params = SamplingParams(
        temperature=1, seed=SEED, max_tokens=max_tokens, logit_bias={end: THINK_BIAS}
    )
    return offline.chat(USER, params, use_tqdm=False, **kwargs)[0].outputs[0].text


def cut(text: str) -> tuple[str, str | None]:
    """The oracle: the text before `</think>` (its `<think>` dropped) and after (None if empty)."""
    thought, tag, answer = text.partition("</think>")
    if not tag:
        return text.replace("<think>", "", 1), None
    return thought.replace("<think>", "", 1), answer or None


def streamed(chunks) -> dict:
    """A stream's deltas added up, field by field."""
    added = {"reasoning_content": "", "reasoning": "", "content": "", "finish_reason": None}
    for chunk in chunks:
        for choice in chunk.choices:
            for field in ("reasoning_content", "reasoning", "content"):
                added[field] += getattr(choice.delta, field, None) or ""
            added["finish_reason"] = choice.finish_reason or added["finish_reason"]
    return added


def test_the_thinking_is_reasoning_content_and_the_answer_content(client, offline, end):
    reasoning, content = cut(offline_text(offline, end))
    assert len(reasoning) > 0 and content  # it thought, then answered
    whole = client.chat.completions.create(**thinking(end))
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, content)
    assert message.reasoning == reasoning  # vLLM's name since 0.11
    added = streamed(client.chat.completions.create(**thinking(end), stream=True))
    assert (added["reasoning_content"], added["content"]) == (reasoning, content)
    assert added["reasoning"] == reasoning
    assert added["finish_reason"] == whole.choices[0].finish_reason


def test_a_reply_cut_off_inside_the_thinking_is_all_reasoning(client, offline, end):
    text = offline_text(offline, end, max_tokens=3)
    assert "</think>" not in text
    whole = client.chat.completions.create(**thinking(end, max_tokens=3))
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (text, None)
    assert whole.choices[0].finish_reason == "length"
    added = streamed(client.chat.completions.create(**thinking(end, max_tokens=3), stream=True))
    assert (added["reasoning_content"], added["content"]) == (text, "")


def test_with_thinking_off_the_whole_reply_is_the_answer(client, offline, end):
    off = {"enable_thinking": False}
    text = offline_text(offline, end, chat_template_kwargs=off)
    assert "</think>" in text  # the bias writes one: it is text of the answer now
    body = thinking(end, extra_body={"chat_template_kwargs": off})
    message = client.chat.completions.create(**body).choices[0].message
    assert (message.reasoning_content, message.content) == (None, text)
    added = streamed(client.chat.completions.create(**body, stream=True))
    assert (added["reasoning_content"], added["content"]) == ("", text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_holds_the_answer_after_the_thinking(client, offline, end, stream):
    reasoning, free_answer = cut(offline_text(offline, end))
    with pytest.raises(ValueError):  # unconstrained, the answer is noise
        json.loads(free_answer)
    schema = {"name": "answer", "schema": ANSWER, "strict": True}
    body = thinking(end, response_format={"type": "json_schema", "json_schema": schema})
    response = client.chat.completions.create(**body, stream=stream)
    if stream:
        added = streamed(response)
    else:
        message = response.choices[0].message
        added = {"reasoning_content": message.reasoning_content, "content": message.content}
        added["finish_reason"] = response.choices[0].finish_reason
    assert added["reasoning_content"] == reasoning  # the thinking, as free as without a schema
    jsonschema.validate(json.loads(added["content"]), ANSWER)
    assert added["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_call_comes_after_the_thinking(client, offline, end, stream):
    reasoning, _ = cut(offline_text(offline, end))
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = thinking(end, tools=[WEATHER], tool_choice=named)
    response = client.chat.completions.create(**body, stream=stream)
    if stream:
        thought, arguments, names, finish = "", "", [], None
        for chunk in response:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            assert not delta.content
            for piece in delta.tool_calls or ():
                names += [piece.function.name] if piece.function.name else []
                arguments += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    else:
        choice = response.choices[0]
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0].function
        thought, arguments, names = choice.message.reasoning_content, call.arguments, [call.name]
        finish = choice.finish_reason
    assert thought == reasoning
    assert names == ["get_weather"] and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_a_replys_thinking_given_back_reaches_the_template(server):
    call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        *USER,
        {"role": "assistant", "content": None, "reasoning_content": "Ask.", "tool_calls": [call]},
        {"role": "tool", "content": "rain"},
    ]
    prompt = rendered(server, messages=messages, tools=[WEATHER])
    assert "<think>\nAsk.\n</think>\n\n<tool_call>" in prompt
