"""What a request body holds its output to (structured outputs): OpenAI's `response_format`
(text, json_object, json_schema), vLLM's `structured_outputs` extra field (json, regex, choice,
grammar, json_object), or a tool_choice that forces a call (tools.py). One at most. The engine
compiles it; a bad one is a 400 whose `param` is the field the body gave it in."""

from dataclasses import fields

from nanovllm.entrypoints.tools import FUNCTION_NAME, ToolCalling
from nanovllm.structured import StructuredOutputsParams

SOURCES = ("response_format", "structured_outputs", "tool_choice")


def structured_outputs(body: dict, chat: bool) -> StructuredOutputsParams | None:
    """The body's constraint on its output, or None."""
    if not chat and body.get("tools"):
        raise ValueError("tools: tool calling is served on /v1/chat/completions")
    found = {
        "response_format": from_response_format(body.get("response_format")),
        "structured_outputs": from_extra_field(body.get("structured_outputs")),
    }
    calling = ToolCalling.from_body(body) if chat else None
    found["tool_choice"] = None if calling is None else calling.constraint()
    given = [name for name, constraint in found.items() if constraint is not None]
    if len(given) > 1:
        raise ValueError(
            f"{given[0]}: only one of response_format, structured_outputs and a tool_choice "
            f"that forces a call may constrain the output; got {' and '.join(given)}"
        )
    return found[given[0]] if given else None


def source(body: dict) -> str | None:
    """The field the body's constraint came from: where a compile error points."""
    if body.get("tool_choice") not in (None, "none", "auto") and body.get("tools"):
        return "tools"  # the schema is built from their parameters
    return next((name for name in SOURCES[:2] if body.get(name) is not None), None)


def from_response_format(value: object) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise TypeError(
            "response_format must be an object whose type is text, json_object or json_schema"
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ValueError(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise TypeError("response_format.json_schema must be an object: {name, schema, strict}")
    if not isinstance(spec.get("name"), str) or not FUNCTION_NAME.fullmatch(spec["name"]):
        raise ValueError("response_format.json_schema.name must match [a-zA-Z0-9_-]{1,64}")
    if not isinstance(spec.get("schema"), dict):
        raise ValueError("response_format.json_schema.schema must be a JSON schema object")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise TypeError("response_format.json_schema.strict must be true or false")
    return StructuredOutputsParams(json=spec["schema"])  # strict or not, it is followed


def from_extra_field(value: object) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs`: StructuredOutputsParams' fields as an object."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"structured_outputs must be an object, got {type(value).__name__}")
    # vLLM's fields; where the grammar starts is the server's to say (its reasoning parser)
    known = {f.name for f in fields(StructuredOutputsParams)} - {"reasoning_end_token_id"}
    if unknown := sorted(set(value) - known):
        raise ValueError(
            f"structured_outputs has unknown field(s) {', '.join(unknown)}; "
            f"it takes {', '.join(sorted(known))}"
        )
    return StructuredOutputsParams(**value)
