"""logprobs and prompt_logprobs against transformers' log_softmax of its own logits
(float32, within 1e-4): the raw distribution, before temperature and penalties, through
chunked prefill, prefix caching, preemption and TP=2; which rows are computed, by
plain reasoning."""

import pytest
import torch
from conftest import hf_model

from nanovllm import LLM, SamplingParams
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence, logits_rows
from nanovllm.runner.step_inputs import prepare_inputs
from nanovllm.sampling.logprobs import find_logprob_rows

BLOCK = 16
TOL = 1e-4


def make_prompts(lengths, seed=0, vocab=500) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_logprobs(path: str, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row p is transformers' log_softmax for the token after position p."""
    with torch.inference_mode():
        logits = hf_model(path)(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)


def assert_entry(entries: dict, row: torch.Tensor, chosen: int, k: int) -> None:
    """The chosen token and the top k of `row`, each logprob within TOL and each rank
    consistent with the oracle's order (ties within TOL may go either way)."""
    assert chosen in entries and len(entries) in (k, k + 1)
    # k + 1 entries: the chosen token is not among the top k
    top = [lp.rank for t, lp in entries.items() if t != chosen or len(entries) == k]
    assert sorted(top) == list(range(1, k + 1))
    for token, lp in entries.items():
        expected = row[token].item()
        assert abs(lp.logprob - expected) < TOL, (token, lp, expected)
        assert (row > expected + TOL).sum().item() < lp.rank <= (row >= expected - TOL).sum().item()
        assert lp.decoded_token is not None


def assert_request_matches_hf(path: str, out, k: int, prompt_k: int | None) -> None:
    prompt = out.prompt_token_ids
    for completion in out.outputs:
        ids = prompt + completion.token_ids
        rows = hf_logprobs(path, ids)
        assert len(completion.logprobs) == len(completion.token_ids)
        for j, (entries, token) in enumerate(zip(completion.logprobs, completion.token_ids)):
            assert_entry(entries, rows[len(prompt) - 1 + j], token, k)
        expected = sum(
            rows[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion.token_ids)
        )
        assert abs(completion.cumulative_logprob - expected) < TOL * len(completion.token_ids)
    if prompt_k is None:
        assert out.prompt_logprobs is None
        return
    rows = hf_logprobs(path, prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        assert_entry(out.prompt_logprobs[p], rows[p - 1], prompt[p], prompt_k)


@pytest.fixture(scope="module")
def path(checkpoints) -> str:
    return str(checkpoints["gqa"])


def test_logprobs_are_the_raw_distribution_before_temperature_and_penalties(path):
    prompts = make_prompts([5, 21, 40], seed=1)
    params = [
        SamplingParams(
            temperature=0.7,
            repetition_penalty=1.4,
            seed=3,
            max_tokens=12,
            ignore_eos=True,
            logprobs=4,
            prompt_logprobs=3,
        ),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=0),
        SamplingParams(
            temperature=1.3, top_k=5, max_tokens=7, ignore_eos=True, logprobs=2, prompt_logprobs=0
        ),
    ]
    # a budget of 16 tokens: the 21- and 40-token prompts are prefilled in chunks
    with LLM(
        path, kvcache_block_size=BLOCK, num_kvcache_blocks=32, max_num_batched_tokens=16
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for out, sp in zip(outs, params):
        assert_request_matches_hf(path, out, sp.logprobs, sp.prompt_logprobs)


def test_prompt_logprobs_are_all_there_even_when_the_prompt_is_in_the_prefix_cache(path):
    prompt = make_prompts([3 * BLOCK + 4], seed=2)[0]
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    asking = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=2
    )
    with LLM(path, kvcache_block_size=BLOCK, num_kvcache_blocks=32) as llm:
        first = llm.generate([prompt], asking, use_tqdm=False)[0]
        cached = llm.generate([prompt], plain, use_tqdm=False)[0]  # 3 blocks are hits
        again = llm.generate([prompt], asking, use_tqdm=False)[0]  # hits not taken
    assert (first.num_cached_tokens, cached.num_cached_tokens) == (0, 3 * BLOCK)
    assert again.num_cached_tokens == 0
    assert cached.outputs[0].logprobs is None and cached.prompt_logprobs is None
    for out in (first, again):
        assert_request_matches_hf(path, out, 1, 2)


def test_logprobs_survive_forced_preemption_in_decode_and_in_the_middle_of_a_prompt(
    path, monkeypatch
):
    preempted = []  # (prompt logprobs owed, entries recorded) of each victim
    real_preempt = Scheduler.preempt
    monkeypatch.setattr(
        Scheduler,
        "preempt",
        lambda self, seq: (
            preempted.append((seq.needs_prompt_logits, len(seq.prompt_logprobs or ()))),
            real_preempt(self, seq),
        ),
    )
    decoding = make_prompts([20, 30, 12, 25], seed=4)
    params = SamplingParams(
        temperature=0.9, seed=5, max_tokens=20, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    # 8 blocks: the 15-token prompt decodes into a 2nd block while the 100-token one holds
    # the other 7 a chunk of 16 at a time, so that one is preempted mid-prompt.
    long_decode = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    long_prompt = SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=3
    )
    with LLM(
        path, kvcache_block_size=BLOCK, num_kvcache_blocks=8, max_num_batched_tokens=24
    ) as llm:
        outs = llm.generate(decoding, params, use_tqdm=False)
        assert preempted and not any(owed for owed, _ in preempted)
        llm.scheduler.max_num_batched_tokens = 16
        mixed = llm.generate(
            make_prompts([15, 100], seed=8), [long_decode, long_prompt], use_tqdm=False
        )
    assert (True, 1 + 16) in preempted  # after the chunks of 1 and 15 tokens
    for out in outs:
        assert_request_matches_hf(path, out, 3, 2)
    assert_request_matches_hf(path, mixed[0], 1, None)
    assert_request_matches_hf(path, mixed[1], 2, 3)


@pytest.mark.slow
def test_logprobs_with_tensor_parallelism_are_gathered_on_rank_0(path):
    prompts = make_prompts([7, 37], seed=6)
    params = SamplingParams(
        temperature=0.8, seed=1, max_tokens=10, ignore_eos=True, logprobs=5, prompt_logprobs=4
    )
    with LLM(
        path,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=32,
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        assert_request_matches_hf(path, out, 5, 4)


# -- which rows, by plain reasoning ---------------------------------------------------


def chunk(seq: Sequence, start: int, n: int) -> Sequence:
    seq.num_cached_tokens, seq.num_scheduled_tokens = start, n
    seq.block_table.extend(range(seq.num_blocks))
    return seq


def test_without_logprobs_the_lm_head_computes_one_row_per_sequence():
    seqs = [
        chunk(Sequence(list(range(3, 43)), SamplingParams(), 16), 0, 40),
        chunk(Sequence([5, 6, 7], SamplingParams(), 16), 0, 3),
    ]
    assert logits_rows(seqs) is None and find_logprob_rows(seqs, None) is None
    ctx = prepare_inputs(seqs, 16).context
    assert ctx.logits_indices.tolist() == [39, 42]


def test_a_prompt_chunk_owing_prompt_logprobs_gets_every_row_and_the_last_samples():
    owing = chunk(Sequence(list(range(3, 43)), SamplingParams(prompt_logprobs=1), 16), 32, 8)
    owing.prompt_logprobs += [{}] * 32  # None + tokens 1..32 recorded by the first chunk
    other = chunk(Sequence([5, 6, 7], SamplingParams(logprobs=2), 16), 0, 3)
    seqs = [other, owing]
    assert logits_rows(seqs) == [1, 8]
    ctx = prepare_inputs(seqs, 16).context
    assert ctx.logits_indices.tolist() == [2, *range(3, 11)]
    asked = find_logprob_rows(seqs, logits_rows(seqs))
    # owing's rows 1..7 predict tokens 33..39; its row 8 (token 40) would be sampled
    assert asked.picks == [*range(1, 8), 0] and asked.prompt_targets == owing.token_ids[33:40]
    assert asked.prompt_counts == [0, 7] and asked.sample_rows == [0] and asked.ks == [1] * 7 + [2]


def test_a_prompt_recomputed_after_preemption_predicts_only_tokens_not_recorded_yet():
    seq = chunk(Sequence(list(range(3, 43)), SamplingParams(prompt_logprobs=0), 16), 0, 40)
    seq.prompt_logprobs += [{}] * 20  # preempted after a chunk of 20 rows: tokens 1..20 done
    asked = find_logprob_rows([seq], logits_rows([seq]))
    assert asked.picks == list(range(20, 39)) and asked.prompt_targets == seq.token_ids[21:40]
    assert not asked.sample_rows  # no logprobs asked for the sampled token
    seq.prompt_logprobs += [{}] * 19  # all 40 entries: nothing owed, one row again
    assert not seq.needs_prompt_logits and logits_rows([seq]) is None
