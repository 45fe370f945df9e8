"""Mixed steps (decode rows and prefill chunks in one forward) against transformers:
prompts that arrive while others decode get the same greedy tokens as transformers
gives each alone, and so do the requests that kept decoding beside them."""

import pytest
import torch
from arrivals import mixed_steps, run_with_arrivals
from conftest import hf_greedy
from invariants import check_scheduler

from nanovllm import LLM, SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(lengths, seed, prefix=()) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def expected(path, all_prompts) -> list[list[int]]:
    return [hf_greedy(str(path), tuple(p), GREEDY.max_tokens) for p in all_prompts]


@pytest.mark.parametrize("shape", ["gqa", "mqa"])
def test_prompts_arriving_during_decode_match_transformers(checkpoints, shape):
    early, late = prompts([5, 9, 17], seed=21), prompts([70, 3, 41], seed=20)
    with LLM(
        str(checkpoints[shape]),
        device="cpu",
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        max_num_batched_tokens=32,
    ) as llm:
        tokens, steps = run_with_arrivals(llm, early, late, GREEDY)
    assert tokens == expected(checkpoints[shape], early + late)
    assert mixed_steps(steps) >= 3  # the 70-token prompt alone is chunked over 3 steps


def test_mixed_steps_with_prefix_hits_match_transformers(checkpoints):
    shared = prompts([2 * BLOCK], seed=22)[0]
    early = prompts([4, 11], seed=23, prefix=shared)
    late = prompts([6, 30], seed=24, prefix=shared)
    with LLM(
        str(checkpoints["gqa"]),
        device="cpu",
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        max_num_batched_tokens=24,
    ) as llm:
        tokens, steps = run_with_arrivals(llm, early, late, GREEDY)
        assert llm.scheduler.block_manager.num_cache_hit_blocks >= 2 * len(late)
    assert tokens == expected(checkpoints["gqa"], early + late)
    assert mixed_steps(steps) >= 1


def test_mixed_steps_under_forced_preemption_match_transformers(checkpoints):
    early, late = prompts([20, 28, 12], seed=25), prompts([40, 25], seed=26)
    with LLM(
        str(checkpoints["gqa"]),
        device="cpu",
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=9,
        max_num_batched_tokens=32,
    ) as llm:
        tokens, steps = run_with_arrivals(llm, early, late, GREEDY)
        assert llm.scheduler.num_preemptions > 0
        check_scheduler(llm.scheduler)
    assert tokens == expected(checkpoints["gqa"], early + late)
    assert mixed_steps(steps) >= 1


def test_prefill_first_gives_the_same_tokens_but_no_mixed_step(checkpoints):
    early, late = prompts([5, 9], seed=21), prompts([70], seed=20)
    with LLM(
        str(checkpoints["gqa"]),
        device="cpu",
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        max_num_batched_tokens=32,
        scheduling_policy="prefill_first",
    ) as llm:
        tokens, steps = run_with_arrivals(llm, early, late, GREEDY)
    assert tokens == expected(checkpoints["gqa"], early + late)
    assert mixed_steps(steps) == 0
