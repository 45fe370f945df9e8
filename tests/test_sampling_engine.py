"""Sampling options through the whole engine, against Hugging Face `transformers` on the
same tiny checkpoints (float32, CPU)."""

import pytest
import torch
from conftest import assert_clear_argmax, hf_greedy, hf_model
from invariants import check_scheduler
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from nanovllm import LLM, SamplingParams

BLOCK = 16
NEW_TOKENS = 24


def make_prompts(lengths, seed=0, vocab=500) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llm(checkpoints):
    with LLM(str(checkpoints["gqa"]), kvcache_block_size=BLOCK, num_kvcache_blocks=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def path(checkpoints) -> str:
    return str(checkpoints["gqa"])


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_rows_beside_sampled_rows_match_transformers_greedy(llm, path):
    prompts = make_prompts([3, 7, BLOCK, 20, 1, 9])
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW_TOKENS, ignore_eos=True)
    params = [greedy if i % 2 == 0 else sampled for i in range(len(prompts))]
    out = token_ids(llm, prompts, params)
    assert out[::2] == [hf_greedy(path, tuple(p), NEW_TOKENS) for p in prompts[::2]]


def test_top_k_1_equals_greedy(llm, path):
    prompts = make_prompts([4, 11], seed=1)
    params = [
        SamplingParams(temperature=1.3, top_k=1, seed=seed, max_tokens=NEW_TOKENS, ignore_eos=True)
        for seed in (None, 5)
    ]
    assert token_ids(llm, prompts, params) == [
        hf_greedy(path, tuple(p), NEW_TOKENS) for p in prompts
    ]


def test_seeded_requests_give_the_same_tokens_alone_or_in_any_batch_position(llm):
    seeded_prompts = make_prompts([5, 12, 3], seed=2)
    seeded = [
        SamplingParams(temperature=1.0, top_p=0.95, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True)
        for s in (11, 12, 13)
    ]
    other_prompts = make_prompts([8, 2, 17], seed=3)
    others = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
        SamplingParams(
            temperature=0.7, top_k=5, repetition_penalty=1.3, max_tokens=15, ignore_eos=True
        ),
    ]
    alone = [token_ids(llm, [p], sp)[0] for p, sp in zip(seeded_prompts, seeded)]
    requests = list(zip(seeded_prompts + other_prompts, seeded + others))
    for order in ([0, 1, 2, 3, 4, 5], [3, 2, 4, 0, 5, 1], [5, 4, 3, 1, 0, 2]):
        batch = [requests[i] for i in order]
        out = token_ids(llm, [p for p, _ in batch], [sp for _, sp in batch])
        assert [out[order.index(i)] for i in range(3)] == alone
    assert len({tuple(t) for t in alone}) == 3


def reference_penalized_greedy(path: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """transformers' forward and RepetitionPenaltyLogitsProcessor, plus presence and
    frequency in plain Python (transformers has no processor for them), then argmax."""
    ids, steps = list(prompt), []
    repetition = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    for _ in range(params.max_tokens):
        with torch.inference_mode():
            logits = hf_model(path)(torch.tensor([ids])).logits[:, -1]
        logits = repetition(torch.tensor([ids]), logits)[0]
        completion = ids[len(prompt) :]
        for token in set(completion):
            logits[token] -= (
                params.frequency_penalty * completion.count(token) + params.presence_penalty
            )
        ids.append(int(logits.argmax()))
        steps.append(logits)
    assert_clear_argmax(torch.stack(steps), f"penalized prompt {prompt[:8]}...")
    return ids[len(prompt) :]


def test_penalized_greedy_matches_transformers_through_preemption(checkpoints, path):
    prompts = make_prompts([20, 30, 12, 25], seed=8, vocab=40)  # small vocab: many repeats
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            repetition_penalty=r,
            presence_penalty=pp,
            frequency_penalty=f,
        )
        for r, pp, f in [(1.5, 0, 0), (1.0, 0.6, 0.4), (1.3, -0.5, 1.0), (0.8, 0, 0)]
    ]
    with LLM(path, kvcache_block_size=BLOCK, num_kvcache_blocks=7) as small:
        out = token_ids(small, prompts, params)
        assert small.scheduler.num_preemptions > 0
    assert out == [reference_penalized_greedy(path, p, sp) for p, sp in zip(prompts, params)]
    assert out[0] != hf_greedy(path, tuple(prompts[0]), 20)  # the penalty changed something


def hf_greedy_with_eos(path: str, prompt: list[int], eos: int, min_new_tokens: int) -> list[int]:
    out = hf_model(path).generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=eos,
        min_new_tokens=min_new_tokens,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    # scores: the logits after min_new_tokens masked EOS, which each token is the argmax of
    assert_clear_argmax(torch.stack(out.scores)[:, 0], f"prompt {prompt[:8]}... with EOS {eos}")
    return out.sequences[0, len(prompt) :].tolist()


def test_stop_token_ids_and_min_tokens_match_transformers_eos_handling(llm, path):
    prompt = make_prompts([6], seed=5)[0]
    greedy = hf_greedy(path, tuple(prompt), NEW_TOKENS)
    stop_at = next(i for i in range(2, NEW_TOKENS) if greedy[i] not in greedy[:i])
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=[greedy[stop_at]])
    delayed = SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=[greedy[1]], min_tokens=3
    )
    outs = llm.generate([prompt, prompt], [plain, delayed], use_tqdm=False)
    assert (
        outs[0]["token_ids"]
        == greedy[: stop_at + 1]
        == hf_greedy_with_eos(path, prompt, greedy[stop_at], 0)
    )
    assert outs[0]["finish_reason"] == "stop"
    assert outs[0]["text"] == llm.tokenizer.decode(greedy[:stop_at])  # stop token not in text
    expected = hf_greedy_with_eos(path, prompt, greedy[1], 3)
    assert outs[1]["token_ids"] == expected and expected[1] != greedy[1]
    ended_on_stop = expected[-1] == greedy[1]
    assert outs[1]["finish_reason"] == ("stop" if ended_on_stop else "length")


def first_stop(path_text, ids: list[int], stop: str) -> int:
    """Tokens up to the one whose text completes `stop` (whole-text decode of prefixes)."""
    return next(n for n in range(1, len(ids) + 1) if stop in path_text(ids[:n]))


def run_alone_step_by_step(llm: LLM, prompt: list[int], params: SamplingParams):
    """Step a single request; returns its output and the engine's state right after the
    step that finished it."""
    llm.add_request(prompt, params)
    while True:
        out = llm.step()
        if out.finished:
            bm = llm.scheduler.block_manager
            check_scheduler(llm.scheduler)
            return out.finished[0], bm.num_free_blocks == bm.num_blocks, list(llm.scheduler.running)


def test_a_stop_string_ends_the_text_before_it_and_frees_blocks_that_step(llm, path):
    prompt = make_prompts([5], seed=6)[0]
    greedy = hf_greedy(path, tuple(prompt), NEW_TOKENS)
    full = llm.tokenizer.decode(greedy)
    # Random weights emit stray bytes (U+FFFD when decoded); a stop string is real text.
    stop = next(
        full[i : i + 3]
        for i in range(4, len(full))
        if full[i : i + 3].isascii() and full[i : i + 3].isprintable()
    )
    n = first_stop(llm.tokenizer.decode, greedy, stop)
    params = SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, stop=["never there \x00", stop]
    )
    output, all_blocks_free, running = run_alone_step_by_step(llm, prompt, params)
    assert output.token_ids == greedy[:n] and output.finish_reason == "stop"
    assert output.text == full[: full.index(stop)]
    assert all_blocks_free and running == []
    capped = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop=stop)
    assert llm.generate([prompt], capped, use_tqdm=False)[0]["finish_reason"] == "stop"


def test_without_a_stop_the_reason_is_length_and_the_text_is_the_whole_decode(llm, path):
    prompt = make_prompts([9], seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=["\x00\x01"])
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(path, tuple(prompt), 10)
    assert out["finish_reason"] == "length" and out["text"] == llm.tokenizer.decode(
        out["token_ids"]
    )


def hf_greedy_biased(path: str, prompt: list[int], bias: dict[int, float], new_tokens: int):
    """transformers' greedy generate under its own SequenceBiasLogitsProcessor (one-token
    sequences: the bias is added to those logits every step): the tokens, and its raw
    log_softmax for each (what logprobs report: the distribution before any bias)."""
    out = hf_model(path).generate(
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        sequence_bias=[[[t], b] for t, b in bias.items()],
    )
    assert_clear_argmax(torch.stack(out.scores)[:, 0], f"biased prompt {prompt[:8]}...")
    tokens = out.sequences[0, len(prompt) :].tolist()
    raw = torch.stack(out.logits)[:, 0].float().log_softmax(-1)
    return tokens, [raw[j, t].item() for j, t in enumerate(tokens)]


def test_logit_bias_matches_transformers_sequence_bias_and_leaves_logprobs_raw(llm, path):
    prompts = make_prompts([5, 13, 9], seed=11)
    greedy = [hf_greedy(path, tuple(p), NEW_TOKENS) for p in prompts]
    # Against the first two greedy tokens of each prompt, for a token that was not chosen:
    biases = [{g[0]: -4.0, g[1]: -2.5, (g[0] + 7) % 500: 3.0} for g in greedy]
    params = [
        SamplingParams(
            temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logit_bias=b, logprobs=0
        )
        for b in biases
    ]
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts + prompts[:1], params + [plain], use_tqdm=False)
    for out, prompt, bias, unbiased in zip(outs, prompts, biases, greedy):
        tokens, raw = hf_greedy_biased(path, prompt, bias, NEW_TOKENS)
        completion = out.outputs[0]
        assert completion.token_ids == tokens != unbiased
        logprobs = [entries[t].logprob for entries, t in zip(completion.logprobs, tokens)]
        assert logprobs == pytest.approx(raw, abs=1e-4)
    assert outs[-1].outputs[0].token_ids == greedy[0]  # the unbiased row beside them


def test_logit_bias_reaches_sampled_rows_and_min_tokens_outranks_it(llm):
    prompt = make_prompts([6], seed=12)[0]
    forced = SamplingParams(
        temperature=1.0, max_tokens=6, ignore_eos=True, seed=3, logit_bias={42: 100.0}
    )
    banned = SamplingParams(
        temperature=1.5,
        max_tokens=NEW_TOKENS,
        ignore_eos=True,
        seed=4,
        logit_bias=dict.fromkeys(range(250), -100.0),
    )
    # 42 is a stop id, +100 but forbidden (-inf) for the first three tokens: it ends the fourth
    stop = SamplingParams(
        temperature=1.0,
        max_tokens=NEW_TOKENS,
        stop_token_ids=[42],
        min_tokens=3,
        logit_bias={42: 100.0},
    )
    out_forced, out_banned, out_stop = token_ids(llm, [prompt] * 3, [forced, banned, stop])
    assert out_forced == [42] * 6
    assert min(out_banned) >= 250
    assert len(out_stop) == 4 and out_stop[-1] == 42 and 42 not in out_stop[:3]
