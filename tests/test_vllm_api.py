"""What a vLLM script reads and writes: prompt dicts, LLM.chat, get_tokenizer, the
RequestOutput / CompletionOutput shapes (and nano-vLLM's out["text"]), stop_reason,
include_stop_str_in_output, skip_special_tokens, max_tokens=None."""

import pytest
import torch
from conftest import hf_greedy, hf_model

from nanovllm import LLM, SamplingParams
from nanovllm.core.sequence import FinishReason, Sequence
from nanovllm.outputs import CompletionOutput, RequestOutput

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
USER = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def llm(bos_checkpoint):
    with LLM(
        str(bos_checkpoint), kvcache_block_size=BLOCK, num_kvcache_blocks=32, max_model_len=64
    ) as llm:
        yield llm


def test_text_token_and_dict_prompts_give_the_same_completion(llm, bos_checkpoint):
    text = "def f(x):"
    ids = llm.get_tokenizer().encode(text)
    assert ids[0] == llm.tokenizer.convert_tokens_to_ids("<|endoftext|>")  # text gets the BOS
    outs = llm.generate(
        [text, ids, {"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False
    )
    assert [o.prompt for o in outs] == [text, None, text, None]
    assert all(o.prompt_token_ids == ids and o.finished for o in outs)
    # the BOS is also the pad id hf_greedy names: transformers would mask it out unless told
    expected = (
        hf_model(str(bos_checkpoint))
        .generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )[0, len(ids) :]
        .tolist()
    )
    assert [o.outputs[0].token_ids for o in outs] == [expected] * 4
    single = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in single] == [expected]


def test_outputs_speak_vllm_and_nano_vllm(llm):
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)
    completion = out.outputs[0]
    assert (out["text"], out["token_ids"], out["finish_reason"]) == (
        completion.text,
        completion.token_ids,
        "length",
    )
    assert completion.finished() and completion.stop_reason is None
    assert completion.logprobs is None and completion.cumulative_logprob is None
    assert isinstance(out.request_id, str) and out.prompt_logprobs is None
    with pytest.raises(KeyError):
        out["outputs"]


def test_a_request_output_is_nano_vllms_dict(llm):
    """nano-vLLM's generate returned {"text": decode(completion ids), "token_ids": ids}."""
    out = llm.generate(["def main():"], GREEDY, use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    nano_vllm = {"text": llm.tokenizer.decode(ids), "token_ids": ids}
    assert dict(out) == nano_vllm
    assert list(out.keys()) == ["text", "token_ids"] and len(out) == 2
    assert list(out.items()) == list(nano_vllm.items()) and list(out.values()) == [out["text"], ids]
    assert "text" in out and "outputs" not in out
    assert out.get("text") == nano_vllm["text"] and out.get("missing", 7) == 7
    assert {**out} == nano_vllm  # what dict-style scripts do with it


def test_logprobs_beyond_max_logprobs_are_refused(llm, bos_checkpoint):
    for params in (SamplingParams(logprobs=21), SamplingParams(prompt_logprobs=21)):
        with pytest.raises(ValueError, match="max_logprobs=20"):
            llm.generate(["x"], params, use_tqdm=False)
    with LLM(str(bos_checkpoint), num_kvcache_blocks=8, max_model_len=64, max_logprobs=2) as two:
        with pytest.raises(ValueError, match="max_logprobs=2"):
            two.generate(["x"], SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
        out = two.generate(["x"], SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)[0]
        assert [len(entry) >= 2 for entry in out.outputs[0].logprobs] == [True, True]
    assert llm.generate(["x"], GREEDY, use_tqdm=False)  # the engine stays usable


def test_chat_is_generate_on_the_rendered_template_without_a_second_bos(llm):
    rendered = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"  # the demo template
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    out = llm.chat(USER, GREEDY, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt == rendered and out[0].prompt_token_ids == ids
    assert out[0]["token_ids"] == llm.generate([ids], GREEDY, use_tqdm=False)[0]["token_ids"]
    two = llm.chat(
        [USER, USER + [{"role": "assistant", "content": "yo"}]],
        GREEDY,
        add_generation_prompt=False,
        use_tqdm=False,
    )
    assert [o.prompt for o in two] == [
        "<|im_start|>user\nhi there<|im_end|>\n",
        rendered[: -len("assistant\n")] + "assistant\nyo<|im_end|>\n",
    ]
    # a template that writes the BOS itself (as Llama 3's does) gets exactly one
    template = "<|endoftext|>{{ greeting }} {{ messages[0]['content'] }}"
    own = llm.chat(
        USER,
        GREEDY,
        chat_template=template,
        chat_template_kwargs={"greeting": "Hello"},
        use_tqdm=False,
    )[0]
    assert own.prompt == "<|endoftext|>Hello hi there"
    assert own.prompt_token_ids == llm.tokenizer.encode(own.prompt, add_special_tokens=False)
    assert own.prompt_token_ids.count(own.prompt_token_ids[0]) == 1


def test_chat_refuses_what_is_not_a_conversation(llm):
    for bad in ("hi", [], None):
        with pytest.raises(TypeError, match="messages must be a conversation"):
            llm.chat(bad, GREEDY, use_tqdm=False)


def test_max_tokens_none_generates_up_to_max_model_len(llm, bos_checkpoint):
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False
    )[0]
    assert out["finish_reason"] == "length"
    assert out["token_ids"] == hf_greedy(str(bos_checkpoint), tuple(prompt), 64 - 10)


def test_a_stop_string_is_the_stop_reason_and_kept_in_the_text_when_asked(llm):
    prompt = [9, 8, 7, 6]
    full = llm.generate([prompt], GREEDY, use_tqdm=False)[0]["text"]
    stop = next(
        full[i : i + 2]
        for i in range(3, len(full))
        if full[i : i + 2].isascii() and full[i : i + 2].isprintable()
    )
    before = full[: full.index(stop)]
    for keep, text in ((False, before), (True, before + stop)):
        params = SamplingParams(
            temperature=0,
            max_tokens=12,
            ignore_eos=True,
            stop=stop,
            include_stop_str_in_output=keep,
        )
        completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (completion.text, completion.stop_reason) == (text, stop)
        assert completion.finish_reason == "stop"


def finished(llm, completion: list[int], reason: FinishReason, **params) -> CompletionOutput:
    """The output of a sequence that emitted `completion` and ended for `reason`."""
    seq = Sequence([5, 6, 7], SamplingParams(**params), BLOCK, llm.eos_token_ids)
    for token in completion:
        seq.append_token(token)
    seq.finish_reason = reason
    return llm._completion_output(seq)


def test_special_tokens_and_the_stop_token_in_the_text_as_vllm_has_them(llm):
    im_start, eos = llm.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    word = llm.tokenizer.encode("hello", add_special_tokens=False)
    tokens = [*word, im_start, *word, eos]
    decode = llm.tokenizer.decode
    out = finished(llm, tokens, FinishReason.STOP)
    assert (out.text, out.stop_reason) == ("hellohello", None)  # EOS: no stop_reason
    out = finished(llm, tokens, FinishReason.STOP, skip_special_tokens=False)
    assert out.text == decode(tokens[:-1]) and "<|im_start|>" in out.text
    out = finished(
        llm, tokens, FinishReason.STOP, skip_special_tokens=False, include_stop_str_in_output=True
    )
    assert out.text == decode(tokens) and out.text.endswith("<|im_end|>")
    stop_id = word[0]
    out = finished(llm, [*word, stop_id], FinishReason.STOP, stop_token_ids=[stop_id])
    assert (out.text, out.stop_reason) == ("hello", stop_id)
    out = finished(llm, tokens, FinishReason.LENGTH)
    assert (out.text, out.stop_reason, out.finish_reason) == ("hellohello", None, "length")
