"""Structured outputs and tool calling on the server, as the official `openai` client sees
them: response_format and vLLM's structured_outputs hold the output to its schema (checked
with `jsonschema`), tool_choice "required" and a named function return arguments that
validate against the function's parameters, "auto" parses the Hermes-format call a grammar
forced the model to write, streamed tool-call deltas add up to the whole message, and a bad
format, schema or tool is a 400 naming its field. Random weights: only the constraint makes
these outputs parse."""

import asyncio
import json
import re
import shutil
import threading

import jsonschema
import openai
import pytest
from serving import engine_flags, running_server
from transformers import AutoTokenizer

from nanovllm import SamplingParams
from nanovllm.engine import LLMEngine
from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.entrypoints.tools import ToolCalling, merge_calls
from nanovllm.structured import StructuredOutputsParams
from nanovllm.structured.grammars import Grammars

NAME = "tiny"
ENGINE = dict(device="cpu", max_model_len=1024, num_kvcache_blocks=96, kvcache_block_size=16)
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# Qwen2.5's tool format, in a template of the tiny checkpoint's markers.
TOOLS_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call functions. Their signatures, within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call, return a json object with the function name and arguments within
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"$ref": "#/$defs/zone"}},
            "required": ["zone"],
            "$defs": {"zone": {"enum": ["utc", "cet", "pst"]}},
        },
    },
}
FLAGS = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["ok", "level"],
}


@pytest.fixture(scope="module")
def tools_checkpoint(checkpoints, tmp_path_factory):
    """The gqa checkpoint with a chat template that renders tools, as Qwen's does."""
    path = tmp_path_factory.mktemp("tools") / "gqa_tools"
    shutil.copytree(checkpoints["gqa"], path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def client(tools_checkpoint):
    flags = engine_flags(**ENGINE)
    with running_server(tools_checkpoint, "--served-model-name", NAME, *flags) as running:
        with openai.OpenAI(
            base_url=f"{running.url}/v1", api_key="unused", timeout=120, max_retries=0
        ) as client:
            yield client


def chat(client, **kwargs):
    kwargs = {"max_tokens": 400, "temperature": 0} | kwargs
    return client.chat.completions.create(model=NAME, messages=USER, **kwargs)


def parameters(tool: dict) -> dict:
    return tool["function"]["parameters"]


def test_response_format_json_schema_holds_the_message_to_the_schema(client):
    for strict in (True, False):
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": "flags", "schema": FLAGS, "strict": strict},
        }
        choice = chat(client, response_format=response_format, n=2, temperature=1.0).choices
        for c in choice:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), FLAGS)


def test_response_format_json_object_is_a_json_object(client, tools_checkpoint):
    """Quotes and braces pushed up by logit_bias, so a random model closes its strings."""
    tokenizer = AutoTokenizer.from_pretrained(tools_checkpoint)
    bias = {str(tokenizer.convert_tokens_to_ids(t)): 5 for t in ('"', "}")}
    for stream in (False, True):
        response = chat(
            client, response_format={"type": "json_object"}, logit_bias=bias, stream=stream
        )
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in response if c.choices)
        else:
            text = response.choices[0].message.content
        assert isinstance(json.loads(text), dict)


def test_vllms_structured_outputs_field_on_both_endpoints(client):
    choices = ["sunny", "rainy", "snow and wind"]
    out = chat(client, n=3, temperature=1.0, extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in out.choices)
    regex = r"[0-9]{2}:[0-9]{2} (am|pm)"
    out = client.completions.create(
        model=NAME,
        prompt="def main():",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert re.fullmatch(regex, out.choices[0].text) and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_a_forced_tool_call_validates_and_its_stream_adds_up_to_it(client, tool_choice):
    whole = chat(client, tools=[WEATHER, TIME], tool_choice=tool_choice)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and len({call.id for call in calls}) == len(calls)
    tools = {tool["function"]["name"]: tool for tool in (WEATHER, TIME)}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(
            json.loads(call.function.arguments), parameters(tools[call.function.name])
        )
    if isinstance(tool_choice, dict):
        assert [call.function.name for call in calls] == ["get_weather"]

    streamed: dict[int, dict] = {}
    finish = None
    for chunk in chat(client, tools=[WEATHER, TIME], tool_choice=tool_choice, stream=True):
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for piece in delta.tool_calls or ():
            call = streamed.setdefault(piece.index, {"id": piece.id, "name": "", "arguments": ""})
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (call.function.name, call.function.arguments) for call in calls
    ]
    assert all(c["id"] and c["id"].startswith("call_") for c in streamed.values())


def test_auto_parses_the_call_a_grammar_made_the_model_write_in_the_templates_format(client):
    forced = (
        r'Let me look\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
        r'\{"city": "(Paris|Rome)", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'
    )
    kwargs = dict(tools=[WEATHER, TIME], extra_body={"structured_outputs": {"regex": forced}})
    whole = chat(client, tool_choice="auto", **kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look.\n"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), parameters(WEATHER))
    chunks = list(chat(client, tool_choice="auto", stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    [piece] = [p for c in chunks for p in c.choices[0].delta.tool_calls or ()]
    assert text == "Let me look.\n"
    assert (piece.function.name, piece.function.arguments) == (
        "get_weather",
        call.function.arguments,
    )
    # The tools were rendered into the prompt; "none" renders none and calls none.
    assert whole.usage.prompt_tokens > chat(client, max_tokens=1).usage.prompt_tokens
    none = chat(client, tool_choice="none", **kwargs)
    assert none.usage.prompt_tokens == chat(client, max_tokens=1).usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"


def test_a_conversation_with_a_tool_call_and_its_result_renders(client):
    messages = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    out = client.chat.completions.create(
        model=NAME, messages=messages, tools=[WEATHER], max_tokens=4, temperature=0
    )
    assert out.usage.prompt_tokens > chat(client, tools=[WEATHER], max_tokens=1).usage.prompt_tokens


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(response_format={"type": "xml"}), "response_format"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format",
        ),
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 5}},
                }
            ),
            "response_format",
        ),
        (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs"),
        (
            dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}),
            "structured_outputs",
        ),
        (
            dict(
                response_format={"type": "json_object"},
                extra_body={"structured_outputs": {"regex": "a"}},
            ),
            "response_format",
        ),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools"),
        (dict(tools=[{"type": "retrieval"}]), "tools"),
        (
            dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
        ),
        (dict(tool_choice="required"), "tool_choice"),
        (
            dict(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
                tool_choice="required",
            ),
            "tools",
        ),
        (
            dict(extra_body={"structured_outputs": {"regex": "a"}, "ignore_eos": True}),
            "structured_outputs",
        ),
    ],
)
def test_a_bad_format_schema_or_tool_is_a_400_naming_its_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, **kwargs)
    assert error.value.body["param"] == param, error.value.body
    assert chat(client, max_tokens=2).choices[0].finish_reason == "length"  # still serving


def test_a_grammar_compiling_holds_up_no_other_request(checkpoints, monkeypatch):
    """A request's grammar compiles off the engine thread: while it does (held here), another
    request runs to its end; then the first runs, within its grammar."""
    compiling, release = threading.Event(), threading.Event()
    compile_grammar = Grammars._compile

    def held(self, params):
        compiling.set()
        assert release.wait(60)
        return compile_grammar(self, params)

    monkeypatch.setattr(Grammars, "_compile", held)
    regex = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[a-z]{6}")
    )
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run() -> tuple[str, bool]:
        front = AsyncEngine(LLMEngine(str(checkpoints["gqa"]), **ENGINE))
        front.start()
        try:
            constrained = asyncio.ensure_future(text_of(front, [5, 6, 7], regex))
            await asyncio.to_thread(compiling.wait, 60)
            other = await text_of(front, [8, 9, 10], free)
            held_while_other_ran = not constrained.done()
            release.set()
            return await constrained, held_while_other_ran and bool(other)
        finally:
            release.set()
            front.close()

    text, held_while_other_ran = asyncio.run(asyncio.wait_for(run(), 120))
    assert held_while_other_ran
    assert re.fullmatch("[a-z]{6}", text)


async def text_of(front: AsyncEngine, prompt: list[int], params: SamplingParams) -> str:
    stream = await front.add_request([prompt], params)
    return "".join([delta.text async for batch in front.deltas(stream) for delta in batch])


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_tool_calls_read_from_text_fed_a_character_at_a_time_are_those_of_the_whole(choice):
    """The stream's parser holds back what could begin a tag, so however the text is cut,
    its deltas add up to the non-streamed message."""
    calling = ToolCalling.from_body(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}
            if choice == "named"
            else choice,
        }
    )
    text = {
        "auto": 'Sure <tool <tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n'
        '</tool_call> and <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
        " then <tool_call>not json</tool_call> end <tool_ca",
        "required": '[{"name": "get_time", "parameters": {"zone": "cet"}}, '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}]',
        "named": '{"zone": "pst"}',
    }[choice]
    whole = calling.message({"message": {"content": text}, "finish_reason": "stop"})
    parser = calling.parser()
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
    streamed_text = "".join(d.get("content", "") for d in deltas)
    assert (streamed_text or None) == whole["message"]["content"]
    streamed = [(c["function"]["name"], c["function"]["arguments"]) for c in merge_calls(deltas)]
    expected = [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]
    ]
    assert streamed == expected and whole["finish_reason"] == "tool_calls"
    if choice == "auto":
        assert whole["message"]["content"] == (
            "Sure <tool  and  then <tool_call>not json</tool_call> end <tool_ca"
        )
        assert expected == [("get_time", '{"zone": "utc"}'), ("get_weather", "{}")]
    elif choice == "required":
        assert expected == [("get_time", '{"zone": "cet"}'), ("get_weather", '{"city": "Rome"}')]
    else:
        assert expected == [("get_time", '{"zone": "pst"}')]
