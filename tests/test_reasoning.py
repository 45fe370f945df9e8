"""Thinking mode offline: LLM.chat passes chat_template_kwargs to a template with Qwen3's
enable_thinking switch (tests/thinking.py), as vLLM does, and a structured output with
reasoning_end_token_id leaves the thinking free and holds the answer after `</think>`."""

import json

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st
from thinking import ANSWER, SEED, THINK_BIAS

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.reasoning import ReasoningParser, ThinkingSplitter
from nanovllm.entrypoints.structured import from_extra_field
from nanovllm.structured import StructuredOutputsParams

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


# -- structured outputs after the thinking ---------------------------------------------------


def thinking_params(llm, **kwargs) -> SamplingParams:
    end = llm.tokenizer.convert_tokens_to_ids("</think>")
    return SamplingParams(
        temperature=1, seed=SEED, max_tokens=100, logit_bias={end: THINK_BIAS}, **kwargs
    )


def test_a_grammar_after_the_thinking_holds_the_answer_and_leaves_the_thinking_free(llm):
    end = llm.tokenizer.convert_tokens_to_ids("</think>")
    free = llm.chat(USER, thinking_params(llm), use_tqdm=False)[0].outputs[0]
    constraint = StructuredOutputsParams(json=ANSWER, reasoning_end_token_id=end)
    held = llm.chat(USER, thinking_params(llm, structured_outputs=constraint), use_tqdm=False)
    held = held[0].outputs[0]
    thought = free.token_ids.index(end)
    assert thought >= 3  # it thought a while, freely: the same tokens as without a grammar
    assert held.token_ids[: thought + 1] == free.token_ids[: thought + 1]
    answer = held.text.split("</think>", 1)[1]
    jsonschema.validate(json.loads(answer), ANSWER)
    assert held.finish_reason == "stop"
    with pytest.raises(ValueError):  # without the grammar the answer is noise
        json.loads(free.text.split("</think>", 1)[1])


def test_reasoning_end_token_id_is_checked(llm):
    def params(end: object) -> SamplingParams:
        return SamplingParams(
            structured_outputs=StructuredOutputsParams(json=ANSWER, reasoning_end_token_id=end)
        )

    with pytest.raises(TypeError, match="reasoning_end_token_id must be an int"):
        params("</think>")
    for bad in (10**6, llm.tokenizer.eos_token_id):
        with pytest.raises(ValueError, match="reasoning_end_token_id=.* must be a token"):
            llm.chat(USER, params(bad), use_tqdm=False)
    with pytest.raises(ValueError, match="unknown field"):  # the server's to set, not a body's
        from_extra_field({"json": ANSWER, "reasoning_end_token_id": 5})


# -- the thinking told from the answer ------------------------------------------------------

TEXTS = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "a b", "\n", "<th", "</"]),
    max_size=12,
).map("".join)


def cut(text: str) -> tuple[str, str]:
    """The oracle: before the first </think>, without the first <think>; and after it."""
    thought, _, answer = text.partition("</think>")
    return thought.replace("<think>", "", 1), answer


@given(TEXTS, st.lists(st.integers(0, 40), max_size=6))
def test_the_thinking_splits_as_the_whole_text_however_it_is_cut(text, cuts):
    bounds = [0, *sorted(c for c in cuts if c < len(text)), len(text)]
    splitter = ThinkingSplitter(thinking=True)
    pieces = [splitter.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [splitter.finish()]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == cut(text)
    closed = ThinkingSplitter(thinking=False)  # the prompt closed the thinking: all is answer
    assert closed.feed(text) == ("", text) and closed.finish() == ("", "")


def test_a_reply_starts_inside_the_thinking_unless_its_prompt_closed_it(thinking_checkpoint):
    from transformers import AutoTokenizer

    parser = ReasoningParser.load("qwen3", AutoTokenizer.from_pretrained(thinking_checkpoint))
    assert parser.for_prompt("<|im_start|>assistant\n").thinking
    assert parser.for_prompt("<|im_start|>assistant\n<think>\n").thinking  # DeepSeek-R1's
    assert not parser.for_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n").thinking


def test_a_parser_needs_the_tags_as_tokens_of_their_own(checkpoints, thinking_checkpoint):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="needs <think> as a token of the tokenizer"):
        ReasoningParser.load("qwen3", AutoTokenizer.from_pretrained(checkpoints["gqa"]))
    special = AutoTokenizer.from_pretrained(thinking_checkpoint)
    special.add_special_tokens({"additional_special_tokens": ["</think>"]})
    with pytest.raises(ValueError, match="needs </think> as a token of the tokenizer, not a spe"):
        ReasoningParser.load("deepseek_r1", special)
    with pytest.raises(ValueError, match="is not one of deepseek_r1, qwen3"):
        ReasoningParser.load("granite", special)
