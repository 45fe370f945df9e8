"""A tiny checkpoint that thinks as Qwen3 does, for the thinking-mode tests: the gqa checkpoint
with `<think>` and `</think>` added to its tokenizer as Qwen3's are (tokens of their own, not
special), its embeddings grown to hold them, and a chat template written after Qwen3's: tools in
the system turn, tool calls and results, earlier turns' thinking dropped, and the
`enable_thinking` switch that closes an empty thinking block in the prompt when false."""

import shutil
from pathlib import Path

# A JSON schema for the answer after the thinking.
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "level"],
}
# Random weights never close their thinking by themselves: a bias on </think> makes the seeded
# sample do so after a few tokens (5 with this seed).
THINK_BIAS, SEED = 3.5, 5

# Modelled on Qwen3's chat template (Qwen/Qwen3-0.6B's tokenizer_config.json), in the tiny
# tokenizer's markers: the same branches, shorter words.
QWEN3_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}
{{- '# Tools\\nFunction signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}
{{- '\\n</tools>\\nFor each call, a JSON object within <tool_call></tool_call> XML tags:\\n' }}
{{- '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' }}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages %}
{%- if message.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- set reasoning = message.reasoning_content or '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_query %}
{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
{%- endif %}
{{- content }}
{%- for call in message.tool_calls or [] %}
{%- if content or not loop.first %}{{ '\\n' }}{% endif %}
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- call.function.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
{{- '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}"""


def build_thinking_checkpoint(base: Path, path: Path) -> Path:
    """`base` (a tiny checkpoint) with the thinking tags and QWEN3_TEMPLATE, at `path`."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(base, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tags = [AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")]
    tokenizer.add_tokens(tags)
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(path, safe_serialization=True)
    return path
