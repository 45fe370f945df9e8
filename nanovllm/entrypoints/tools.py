"""Tool calling on /v1/chat/completions (OpenAI's `tools` and `tool_choice`) in Qwen's and
Hermes' format, which the Qwen2.5 and Qwen3 chat templates use: the template renders the tools
into the prompt, and the model calls one as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- "auto" (the default with tools): the text is generated freely; the calls are parsed out of it.
- "required" and a named function: constrained generation (structured outputs) to a JSON schema
  built from the tools' parameters: an array of {"name", "parameters"} objects for "required"
  (vLLM's), the function's parameters themselves for a named one.
- "none": the tools are neither rendered nor called.

A choice's text becomes `message.tool_calls` (ids "call_...", finish_reason "tool_calls") through
one ToolParser, streamed or not, so the deltas of a stream add up to the whole message."""

import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from nanovllm.engine.async_engine import Delta
from nanovllm.entrypoints.responses import with_choice_state
from nanovllm.structured import StructuredOutputsParams

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


@dataclass(slots=True)
class ToolCalling:
    """A request's tools and what tool_choice asks of them."""

    tools: list[dict]  # OpenAI's {"type": "function", "function": {...}} entries
    parameters: dict[str, dict]  # function name -> its parameters' JSON schema
    choice: str  # "auto", "required" or "named"
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls: "required" may call several

    @classmethod
    def from_body(cls, body: dict) -> "ToolCalling | None":
        """The body's tool calling; None without tools or with tool_choice "none"."""
        tools, choice = body.get("tools"), body.get("tool_choice")
        if not tools:
            if choice not in (None, "none", "auto"):
                raise ValueError("tool_choice needs tools: give the functions in `tools`")
            return None
        parameters = check_tools(tools)
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise TypeError(f"parallel_tool_calls must be true or false, got {parallel!r:.40}")
        if choice in (None, "auto", "required"):
            return cls(tools, parameters, choice or "auto", None, parallel is not False)
        if choice == "none":
            return None
        name = named_function(choice)
        if name not in parameters:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        return cls(tools, parameters, "named", name, parallel is not False)

    def constraint(self) -> StructuredOutputsParams | None:
        """What "required" and a named function hold the output to; None for "auto"."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self.parameters[self.name])
        if self.choice == "required":
            return StructuredOutputsParams(json=calls_schema(self.parameters, self.parallel))
        return None

    def parser(self) -> "ToolParser":
        return ToolParser(self)

    def read_calls(self, choice: Callable[[Delta], dict]) -> Callable[[Delta], dict]:
        """`choice` (a Delta -> a non-streamed chat choice) with the text read as tool calls."""
        return lambda delta: self.message(choice(delta))

    def message(self, choice: dict) -> dict:
        """A non-streamed chat choice with its text read as tool calls, where it holds some (its
        other fields, a reasoning model's thinking, kept)."""
        parser = self.parser()
        deltas = parser.feed(choice["message"]["content"] or "") + parser.finish()
        text = "".join(d.get("content", "") for d in deltas)
        calls = merge_calls(deltas)
        message = dict(choice["message"], content=None if calls and not text else text)
        if calls:
            message["tool_calls"] = calls
        return dict(choice, message=message, finish_reason=parser.finish_reason(choice))

    async def stream(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """A chat stream's chunks with each choice's text read as tool calls: `content` deltas
        become `tool_calls` deltas (the first of a call with its id and name, then pieces of
        its arguments), and the last chunk's finish_reason "tool_calls" if it called any."""
        async for chunk, parser in with_choice_state(chunks, self.parser):
            if parser is None:
                yield chunk
                continue
            choice = chunk["choices"][0]
            text = choice["delta"].get("content")
            deltas = parser.feed(text) if text else []
            if choice["finish_reason"] is not None:
                deltas += parser.finish()
                choice = dict(choice, finish_reason=parser.finish_reason(choice))
            # What is not content (a reasoning model's thinking) goes on as it came, first.
            other = {k: v for k, v in choice["delta"].items() if k != "content"}
            if other:
                deltas = [other | deltas[0], *deltas[1:]] if deltas else [other]
            if not deltas and (choice["logprobs"] or choice["finish_reason"]):
                deltas = [{}]  # nothing to say, but the logprobs or the end
            for i, delta in enumerate(deltas):
                last = i == len(deltas) - 1
                yield dict(
                    chunk,
                    choices=[
                        dict(
                            choice,
                            delta=delta,
                            logprobs=choice["logprobs"] if last else None,
                            finish_reason=choice["finish_reason"] if last else None,
                        )
                    ],
                )


class ToolParser:
    """One choice's text, as it grows, into content and tool-call deltas (OpenAI's stream
    shapes). Named: the whole text is the call's arguments, streamed as they come. Required:
    the text is a JSON array of calls, read once complete. Auto: text outside <tool_call>
    blocks is content (a possible start of a tag held back); a block is a call once closed."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self.buffer = ""  # text not yet given out
        self.num_calls = 0

    def feed(self, text: str) -> list[dict]:
        mode = self.calling.choice
        if mode == "named":
            deltas = [] if self.num_calls else [self._call(self.calling.name, "")]
            return deltas + ([argument_delta(text)] if text else [])
        self.buffer += text
        return self._scan() if mode == "auto" else []

    def finish(self) -> list[dict]:
        """What is left once the choice has ended."""
        if self.calling.choice == "named":
            return [] if self.num_calls else [self._call(self.calling.name, "")]
        text, self.buffer = self.buffer, ""
        if self.calling.choice == "required":
            calls = parse_calls(text)
            return [self._call(c.name, c.arguments) for c in calls] if calls else content(text)
        if text.startswith(OPEN):  # a block the model did not close: a call if it parses
            call = parse_call(text[len(OPEN) :])
            return [self._call(call.name, call.arguments)] if call else content(text)
        return content(text)

    def finish_reason(self, choice: dict) -> str | None:
        """A choice that called a tool and ended by itself ends with "tool_calls"."""
        reason = choice["finish_reason"]
        return "tool_calls" if self.num_calls and reason == "stop" else reason

    def _scan(self) -> list[dict]:
        deltas = []
        while True:
            if self.buffer.startswith(OPEN):
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return deltas  # the block is still open
                block, self.buffer = (
                    self.buffer[: end + len(CLOSE)],
                    self.buffer[end + len(CLOSE) :],
                )
                call = parse_call(block[len(OPEN) : end])
                deltas += [self._call(call.name, call.arguments)] if call else content(block)
                continue
            start = self.buffer.find(OPEN)
            if start < 0:  # hold back what could begin a tag
                start = len(self.buffer) - partial_prefix(self.buffer, OPEN)
            if start == 0:
                return deltas
            deltas += content(self.buffer[:start])
            self.buffer = self.buffer[start:]

    def _call(self, name: str, arguments: str) -> dict:
        call = {
            "index": self.num_calls,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        self.num_calls += 1
        return {"tool_calls": [call]}


def merge_calls(deltas: list[dict]) -> list[dict]:
    """The tool calls that stream deltas add up to, as a client adds them up."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", ()):
            if piece["index"] not in calls:  # its first piece: id, type, name
                calls[piece["index"]] = dict(piece, function=dict(piece["function"]))
                del calls[piece["index"]]["index"]
            else:
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    return list(calls.values())


def content(text: str) -> list[dict]:
    return [{"content": text}] if text else []


def argument_delta(text: str) -> dict:
    return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}


def partial_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    return next(
        (n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0
    )


def parse_call(text: str) -> ToolCall | None:
    """A Hermes call, {"name": ..., "arguments": {...}} ("parameters" too); None if it is not."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def parse_calls(text: str) -> list[ToolCall]:
    """The calls of tool_choice "required": a JSON array of {"name", "parameters"}."""
    try:
        calls = json.loads(text)
    except ValueError:
        return []
    if not isinstance(calls, list):
        return []
    parsed = [parse_call(json.dumps(call)) for call in calls]
    return [] if None in parsed else parsed


# -- the request's side --------------------------------------------------------------------


def check_tools(tools: object) -> dict[str, dict]:
    """OpenAI's function tools, checked; function name -> its parameters' JSON schema."""
    if not isinstance(tools, list):
        raise TypeError(f"tools must be a list of function tools, got {type(tools).__name__}")
    parameters = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise ValueError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name', "
                f"'parameters', ...}}}}; other tools are not supported"
            )
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"tools[{i}].function.name must match [a-zA-Z0-9_-]{{1,64}}")
        if name in parameters:
            raise ValueError(f"tools[{i}]: the function name {name!r} is given twice")
        schema = function.get("parameters")
        if schema is not None and not isinstance(schema, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        parameters[name] = schema if schema else {"type": "object", "properties": {}}
    return parameters


def named_function(choice: object) -> str:
    """The function a tool_choice object names."""
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    return function["name"]


def calls_schema(parameters: dict[str, dict], parallel: bool) -> dict:
    """The JSON schema of tool_choice "required": a non-empty array of calls, each one of the
    functions with its parameters. Each schema's $defs move to the root, where their
    "#/$defs/..." references point."""
    defs, variants = {}, []
    for name, schema in parameters.items():
        schema = dict(schema)
        for key, value in (schema.pop("$defs", None) or {}).items():
            if defs.setdefault(key, value) != value:
                raise ValueError(f"tools: two functions define $defs {key!r} differently")
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
            }
        )
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        calls["maxItems"] = 1
    return calls | ({"$defs": defs} if defs else {})


def template_messages(message: dict) -> dict:
    """A message's tool fields for the chat template: an assistant's tool_calls (their
    arguments as objects, which templates render with tojson) and a tool result's id."""
    fields = {key: message[key] for key in ("tool_call_id", "name") if key in message}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise TypeError("messages: tool_calls must be a list of tool call objects")
        fields["tool_calls"] = [dict(c, function=arguments_as_object(c)) for c in calls]
    return fields


def arguments_as_object(call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict):
        raise TypeError("messages: a tool call needs a function: {'name', 'arguments'}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # left as the text it is
    return dict(function, arguments=arguments)
