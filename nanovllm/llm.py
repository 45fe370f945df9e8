"""The public entry point: `from nanovllm import LLM, SamplingParams`.

    llm = LLM("~/huggingface/Qwen3-0.6B/")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.6, max_tokens=64))
    outputs[0]["text"], outputs[0]["token_ids"]
"""
from nanovllm.engine import LLMEngine


class LLM(LLMEngine):
    """An LLMEngine with the tokenizer, generate() and a progress bar; usable as a
    context manager (`with LLM(path) as llm: ...`) that releases memory on exit."""
