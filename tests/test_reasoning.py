"""Thinking mode offline: LLM.chat passes chat_template_kwargs to a template with Qwen3's
enable_thinking switch (tests/thinking.py), as vLLM does."""

import pytest

from nanovllm import LLM, SamplingParams

ENGINE = dict(device="cpu", max_model_len=512, num_kvcache_blocks=64, kvcache_block_size=16)
USER = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(thinking_checkpoint):
    with LLM(str(thinking_checkpoint), **ENGINE) as llm:
        yield llm


def test_chat_passes_enable_thinking_to_the_template(llm):
    on, default, off = (
        llm.chat(USER, GREEDY, use_tqdm=False, chat_template_kwargs=kwargs)[0]
        for kwargs in ({"enable_thinking": True}, None, {"enable_thinking": False})
    )
    assert on.prompt == default.prompt and on.prompt.endswith("<|im_start|>assistant\n")
    assert off.prompt == on.prompt + "<think>\n\n</think>\n\n"
    assert off.prompt_token_ids == llm.tokenizer.encode(off.prompt, add_special_tokens=False)
    think, end = llm.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    ids = off.prompt_token_ids  # the tags are tokens of their own, as Qwen3's
    assert ids.count(think) == ids.count(end) == 1 and ids.index(think) < ids.index(end)
    assert llm.tokenizer.decode(ids[ids.index(end) + 1 :]) == "\n\n"


def test_chat_template_kwargs_must_be_a_dict(llm):
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat(USER, GREEDY, use_tqdm=False, chat_template_kwargs=[("enable_thinking", False)])
