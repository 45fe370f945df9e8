"""The whole engine against Hugging Face `transformers` on the same checkpoints:
greedy tokens identical, prefill logits within 1e-5 (float32, CPU; they agree to ~1e-6)."""

import json
import shutil

import pytest
import torch
from conftest import hf_greedy, hf_model

from nanovllm import LLM, SamplingParams
from nanovllm.core.sequence import Sequence
from nanovllm.runner.step_inputs import prepare_inputs

BLOCK = 16
NEW_TOKENS = 32
# lengths: 1, a few, exactly one block, one block + 1, several blocks (+ a partial one)
PROMPT_LENGTHS = [1, 3, 7, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK + 5, 5 * BLOCK - 1]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_prompts(lengths=PROMPT_LENGTHS, seed=0, vocab=500) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def expected(path, prompts, n=NEW_TOKENS) -> list[list[int]]:
    return [hf_greedy(str(path), tuple(p), n) for p in prompts]


def generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("shape", ["gqa", "mqa"])
def test_greedy_batch_matches_transformers(checkpoints, shape):
    prompts = make_prompts()
    with LLM(str(checkpoints[shape]), kvcache_block_size=BLOCK, num_kvcache_blocks=128) as llm:
        assert generate(llm, prompts) == expected(checkpoints[shape], prompts)


@pytest.mark.parametrize("shape", ["gqa", "mqa"])
def test_reference_continuations_vary_so_they_test_decode(checkpoints, shape):
    # a model that repeats one or two tokens would let a decode step that ignores its
    # context pass; each continuation here has at least 5 distinct tokens of 32
    for tokens in expected(checkpoints[shape], make_prompts()):
        assert len(set(tokens)) >= 5, tokens


@pytest.mark.parametrize("shape", ["gqa", "mqa"])
def test_prefill_logits_match_transformers(checkpoints, shape):
    path = checkpoints[shape]
    prompts = make_prompts([1, 5, BLOCK, 2 * BLOCK + 3], seed=1)
    with LLM(str(path), kvcache_block_size=BLOCK, num_kvcache_blocks=32) as llm:
        runner = llm.model_runner
        seqs = []
        for prompt in prompts:
            seq = Sequence(prompt, GREEDY, BLOCK)
            llm.scheduler.block_manager.allocate(seq, [])
            seq.num_scheduled_tokens = len(prompt)
            seqs.append(seq)
        with torch.inference_mode():
            ours = runner.forward(prepare_inputs(seqs, BLOCK))
    with torch.inference_mode():
        theirs = torch.stack(
            [hf_model(str(path))(torch.tensor([p])).logits[0, -1] for p in prompts]
        )
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-5


def test_one_batch_equals_one_request_at_a_time(checkpoints):
    prompts = make_prompts(seed=2)
    with LLM(str(checkpoints["gqa"]), kvcache_block_size=BLOCK, num_kvcache_blocks=128) as llm:
        batched = generate(llm, prompts)
        alone = [generate(llm, [p])[0] for p in prompts]
    assert batched == alone == expected(checkpoints["gqa"], prompts)


def test_chunked_prefill_equals_whole_prefill(checkpoints):
    prompts = make_prompts([50, 7, 33, 70], seed=3)
    with LLM(
        str(checkpoints["gqa"]),
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
    ) as llm:
        assert generate(llm, prompts) == expected(checkpoints["gqa"], prompts)


def test_shared_prefix_reuses_cached_blocks_and_still_matches(checkpoints):
    path = checkpoints["mqa"]
    prefix = make_prompts([3 * BLOCK], seed=4)[0]
    tails = make_prompts([1, 5, BLOCK, 9], seed=5)
    prompts = [prefix + t for t in tails]
    with LLM(str(path), kvcache_block_size=BLOCK, num_kvcache_blocks=128) as llm:
        first = generate(llm, prompts[:1])
        bm = llm.scheduler.block_manager
        hits_before = bm.num_cache_hit_blocks
        rest = generate(llm, prompts[1:])
        assert bm.num_cache_hit_blocks - hits_before >= 3 * len(prompts[1:])
    assert first + rest == expected(path, prompts)


def test_fully_cached_prompt_matches(checkpoints):
    path = checkpoints["gqa"]
    prompt = make_prompts([2 * BLOCK], seed=6)[0]  # an exact multiple of the block size
    with LLM(str(path), kvcache_block_size=BLOCK, num_kvcache_blocks=32) as llm:
        first = generate(llm, [prompt])
        second = generate(llm, [prompt])
        assert llm.scheduler.block_manager.num_cache_hit_blocks >= 2
    assert first == second == expected(path, [prompt])


def test_preemption_under_a_tiny_cache_still_matches(checkpoints):
    path = checkpoints["gqa"]
    prompts = make_prompts([20, 30, 12, 25, 40, 8], seed=7)
    with LLM(str(path), kvcache_block_size=BLOCK, num_kvcache_blocks=10) as llm:
        out = generate(llm, prompts)
        assert llm.scheduler.num_preemptions > 0
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert out == expected(path, prompts)


def test_string_prompts_go_through_the_tokenizer(checkpoints):
    path = checkpoints["gqa"]
    texts = ["def main():\n    return 0", "import os"]
    with LLM(str(path), kvcache_block_size=BLOCK, num_kvcache_blocks=32) as llm:
        outs = llm.generate(texts, GREEDY, use_tqdm=False)
        ids = [llm.tokenizer.encode(t) for t in texts]
    assert [o["token_ids"] for o in outs] == expected(path, ids)
    assert all(isinstance(o["text"], str) and o["text"] for o in outs)


def test_transformers4_style_config_loads_and_matches(checkpoints):
    path = checkpoints["gqa_v4"]
    config = json.loads((path / "config.json").read_text())
    assert "rope_parameters" not in config and "dtype" not in config
    assert config["rope_theta"] == 1e6 and config["torch_dtype"] == "float32"
    prompts = make_prompts([4, 20], seed=8)
    with LLM(str(path), kvcache_block_size=BLOCK, num_kvcache_blocks=32) as llm:
        assert llm.model_runner.dtype == torch.float32
        assert generate(llm, prompts) == expected(path, prompts)


def test_dtype_auto_takes_a_transformers4_checkpoints_torch_dtype(
    checkpoints, tmp_path, monkeypatch
):
    import nanovllm.platforms.cpu.host as host

    # A CPU that computes bfloat16 natively keeps the checkpoint's dtype (issue 17's rule).
    monkeypatch.setattr(host, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    shutil.copytree(checkpoints["gqa_v4"], tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(dict(config, torch_dtype="bfloat16")))
    with LLM(str(tmp_path / "m"), kvcache_block_size=BLOCK, num_kvcache_blocks=8) as llm:
        runner = llm.model_runner
        assert runner.dtype == torch.bfloat16
        assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
        assert runner.kv_cache.dtype == torch.bfloat16
        assert len(generate(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))[0]) == 2
