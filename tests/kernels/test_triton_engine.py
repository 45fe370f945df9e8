"""The whole engine on the `triton` backend against Hugging Face `transformers`: greedy
tokens identical, through prefill without a prefix, a prefix-cache hit and chunked
prefill (both paged prefill), decode, and mixed steps (decode rows beside chunks)."""

import pytest
import torch
from conftest import hf_greedy
from kernel_cases import DEVICE, requires_kernels

from nanovllm import LLM, SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.cuda
@requires_kernels
def test_triton_backend_greedy_matches_transformers(checkpoints):
    path = checkpoints["gqa"]
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 500, (2 * BLOCK,), generator=g).tolist()
    tails = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 9, 5, 50)]
    # two prompts share a two-block prefix; the last one is longer than the token budget
    prompts = [prefix + tails[0], prefix + tails[1], tails[2], tails[3]]
    with LLM(
        str(path),
        attention_backend="triton",
        device=DEVICE,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=32,
        max_num_batched_tokens=40,
    ) as llm:
        assert llm.model_runner.backend.name == "triton"
        first = generate(llm, prompts[:1])
        block_manager = llm.scheduler.block_manager
        hits_before = block_manager.num_cache_hit_blocks
        rest = generate(llm, prompts[1:])
        assert block_manager.num_cache_hit_blocks - hits_before >= 2
    assert first + rest == [hf_greedy(str(path), tuple(p), GREEDY.max_tokens) for p in prompts]


@pytest.mark.cuda
@requires_kernels
def test_triton_backend_mixed_steps_match_transformers(checkpoints):
    from arrivals import mixed_steps, run_with_arrivals

    path = checkpoints["gqa"]
    g = torch.Generator().manual_seed(12)
    early = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 21)]
    late = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (37, 6)]
    with LLM(
        str(path),
        attention_backend="triton",
        device=DEVICE,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=32,
        max_num_batched_tokens=24,
    ) as llm:
        tokens, steps = run_with_arrivals(llm, early, late, GREEDY)
    assert tokens == [hf_greedy(str(path), tuple(p), GREEDY.max_tokens) for p in early + late]
    assert mixed_steps(steps) >= 1


@pytest.mark.cuda
@requires_kernels
def test_triton_backend_speculative_decoding_matches_transformers(checkpoints):
    """Verified rows (a decode row's token and its drafts, one chunk over the paged cache)
    on the triton backend's prefill, beside plain decode rows."""
    path = checkpoints["gqa"]
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 500, (5,), generator=g).tolist() * 5, [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    with LLM(
        str(path),
        attention_backend="triton",
        device=DEVICE,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=32,
        speculative_config=spec,
    ) as llm:
        tokens = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats().spec_decode.num_accepted_tokens > 0
    assert tokens == [hf_greedy(str(path), tuple(p), params.max_tokens) for p in prompts]
