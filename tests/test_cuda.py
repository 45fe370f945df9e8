"""The CUDA path on a real GPU: decode CUDA graphs against eager mode and transformers (Qwen3,
Llama, Qwen2), KV-cache sizing against gpu_memory_utilization, one host sync per step, compiled
ops against eager ones, and close() releasing everything. Skipped without CUDA; on a GPU box
scripts/gpu_check.sh runs them (`pytest -m cuda`)."""

import gc
import importlib.util
import types

import pytest
import torch
from conftest import hf_greedy
from graph_cases import (
    BLOCK,
    EDGE_MAX_MODEL_LEN,
    edge_of_max_model_len,
    graph_workload,
    record_replays,
)

from nanovllm import LLM, SamplingParams
from nanovllm.demo import build_tiny_qwen3
from nanovllm.engine.overlap import PENDING
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.layernorm import RMSNorm, add_rms_norm, rms_norm
from nanovllm.layers.rotary_embedding import apply_rotary_emb, get_rope
from nanovllm.platforms.cuda.graphs import capture_batch_sizes
from nanovllm.sampling.sampler import softmax_race

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
# float32: the graphs (compiled ops, the decode kernel's split over the buffer's full
# width) and eager mode round differently; in float32 that cannot flip a greedy token.
F32 = dict(device="cuda", dtype="float32")
FEW_GRAPHS = dict(F32, max_num_seqs=8)  # 4 graphs to capture, not 35


def token_ids(outputs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


@pytest.mark.parametrize(
    "backend,block_size",
    [
        ("triton", BLOCK),
        pytest.param(
            "flash_attn",
            256,
            marks=pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn not installed"),
        ),
    ],
)
def test_graphs_give_eager_mode_and_transformers_greedy_tokens(checkpoints, backend, block_size):
    path = str(checkpoints["gqa"])
    prompts, params = graph_workload()
    common = dict(
        F32,
        attention_backend=backend,
        kvcache_block_size=block_size,
        max_num_seqs=40,
        max_num_batched_tokens=96,
    )
    with LLM(path, enforce_eager=True, **common) as llm:
        eager = token_ids(llm.generate(prompts, params, use_tqdm=False))
    with LLM(path, **common) as llm:
        graphs = llm.model_runner.fast_decode
        assert sorted(graphs.graphs) == capture_batch_sizes(40)
        replays = record_replays(graphs)
        replayed = token_ids(llm.generate(prompts, params, use_tqdm=False))
        if block_size == BLOCK:  # the identical prompts share their first two blocks
            assert llm.scheduler.block_manager.num_cache_hit_blocks >= 2
    assert set(replays) - set(capture_batch_sizes(40))  # sizes between captured ones replayed
    assert replayed == eager
    assert replayed == [hf_greedy(path, tuple(p), sp.max_tokens) for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_other_families_with_graphs_give_transformers_greedy_tokens(families, name):
    """Llama (Llama 3's RoPE scaling past position 32, a tied LM head) and Qwen2 (q/k/v biases)
    decode from the graphs what transformers decodes (Qwen3: above; Qwen3-MoE:
    tests/kernels/test_fused_moe.py)."""
    path = str(families[name])
    g = torch.Generator().manual_seed(0)  # test_model_families' prompts: no near-tie in 16 tokens
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 17, 40, 100)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(path, kvcache_block_size=BLOCK, num_kvcache_blocks=64, **FEW_GRAPHS) as llm:
        replays = record_replays(llm.model_runner.fast_decode)
        tokens = token_ids(llm.generate(prompts, greedy, use_tqdm=False))
    assert replays
    assert tokens == [hf_greedy(path, tuple(p), greedy.max_tokens) for p in prompts]


def test_decode_at_the_last_position_of_max_model_len_replays_a_graph(checkpoints):
    path = str(checkpoints["mqa"])
    prompts, lengths = edge_of_max_model_len()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(
        path, kvcache_block_size=BLOCK, max_num_seqs=4, max_model_len=EDGE_MAX_MODEL_LEN, **F32
    ) as llm:
        replays = record_replays(llm.model_runner.fast_decode)
        outputs = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert replays
    assert outputs == [hf_greedy(path, tuple(p), n) for p, n in zip(prompts, lengths)]


@pytest.fixture(scope="module")
def wide_kv_model(tmp_path_factory):
    """32 KiB of float32 KV per token: a cache of max_num_seqs full sequences (64 GiB)
    would not fit the budgets below, so the budget decides the size, not that cap."""
    return build_tiny_qwen3(
        tmp_path_factory.mktemp("wide_kv"),
        hidden_size=256,
        num_heads=8,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=512,
        num_layers=4,
        max_position_embeddings=4096,
    )


def test_kv_cache_sizing_respects_gpu_memory_utilization(wide_kv_model):
    utilization, total = 0.1, torch.cuda.mem_get_info()[1]
    with LLM(str(wide_kv_model), gpu_memory_utilization=utilization, **F32) as llm:
        runner, block_size = llm.model_runner, llm.config.kvcache_block_size
        blocks_per_seq = (llm.config.max_model_len + block_size) // block_size
        assert 1 <= runner.num_kvcache_blocks < llm.config.max_num_seqs * blocks_per_seq
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in range(200, 1800, 50)]
        llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        # everything PyTorch took since the warmup: weights, activations, the cache, graphs
        assert torch.cuda.max_memory_reserved() <= utilization * total
        assert runner.kv_cache.nbytes >= 0.5 * utilization * total  # and most of it is cache


def test_a_budget_below_one_block_says_what_to_change(wide_kv_model):
    tiny = 32 * 2**20 / torch.cuda.mem_get_info()[1]  # 32 MiB: less than the warmup's peak
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        LLM(str(wide_kv_model), gpu_memory_utilization=tiny, **F32)


SAMPLING_OPTIONS = [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    SamplingParams(
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        seed=1,
        min_tokens=3,
        stop_token_ids=[7],
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        max_tokens=8,
        ignore_eos=True,
    ),
    SamplingParams(
        temperature=0.7, top_k=5, max_tokens=8, ignore_eos=True, logit_bias={3: 2.0, 9: -1.5}
    ),
    SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True),
]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_a_step_queues_its_work_without_a_host_sync(checkpoints, enforce_eager):
    """Everything of a step before the sampled ids' .tolist() runs under
    torch.cuda.set_sync_debug_mode("error"), every sampling option on."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 30, 40)]
    with LLM(
        str(checkpoints["gqa"]),
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        enforce_eager=enforce_eager,
        **FEW_GRAPHS,
    ) as llm:
        for _ in range(2):  # compile and grow caches; the second time with prefix-cache hits
            llm.generate(prompts, SAMPLING_OPTIONS, use_tqdm=False)
        for prompt, params in zip(prompts, SAMPLING_OPTIONS):
            llm.add_request(prompt, params)
        kinds = set()
        while not llm.is_finished():
            seqs = llm.scheduler.schedule()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                sampled = llm.model_runner.execute_model(seqs).token_ids
            finally:
                torch.cuda.set_sync_debug_mode("default")
            kinds.add(tuple(sorted({seq.is_prefill for seq in seqs})))
            llm.scheduler.postprocess(seqs, sampled.tolist())
    assert (False,) in kinds and any(True in kind for kind in kinds)  # decode and prefill steps


def test_async_scheduling_feeds_a_step_from_the_one_in_flight_without_a_host_sync(checkpoints):
    """Graphs with async scheduling give the synchronous engine's tokens; a decode step whose
    inputs are still being sampled by the step in flight launches under sync debug "error"."""
    path = str(checkpoints["gqa"])
    prompts, params = graph_workload()
    common = dict(FEW_GRAPHS, kvcache_block_size=BLOCK, max_num_batched_tokens=96)
    with LLM(path, **common) as llm:
        sync = token_ids(llm.generate(prompts, params, use_tqdm=False))
    with LLM(path, async_scheduling=True, **common) as llm:
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == sync
        for prompt in prompts[:4]:
            llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        while not any(seq.last_token == PENDING for seq in llm.scheduler.running):
            llm.step()
        seqs = llm.scheduler.schedule()
        feed = llm.loop.feed(seqs, llm.loop.in_flight)  # rows taken from the step in flight
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            llm.model_runner.execute_model(seqs, feed)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert any(seq.last_token == PENDING for seq in seqs)


def test_enforce_eager_runs_without_graphs_or_compiled_ops(checkpoints):
    path = str(checkpoints["gqa"])
    with LLM(path, num_kvcache_blocks=16, enforce_eager=True, **FEW_GRAPHS) as llm:
        runner = llm.model_runner
        assert runner.fast_decode is None
        assert all(
            n._norm is rms_norm.eager for n in runner.model.modules() if isinstance(n, RMSNorm)
        )
    with LLM(path, num_kvcache_blocks=16, **FEW_GRAPHS) as llm:
        runner = llm.model_runner
        assert runner.fast_decode is not None
        assert all(
            n._norm is not rms_norm.eager for n in runner.model.modules() if isinstance(n, RMSNorm)
        )
    with LLM(path, num_kvcache_blocks=16, attention_backend="torch", **FEW_GRAPHS) as llm:
        assert llm.model_runner.fast_decode is None  # its store_kvcache syncs: decode eagerly


def test_closing_releases_the_graphs_and_the_kv_cache(checkpoints):
    path = str(checkpoints["gqa"])

    def create_use_close() -> int:
        llm = LLM(path, num_kvcache_blocks=512, kvcache_block_size=BLOCK, **FEW_GRAPHS)
        llm.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=4), use_tqdm=False)
        graphs = llm.model_runner.fast_decode
        llm.close()
        assert graphs.graphs == {} and all(
            getattr(graphs, buffer) is None
            for buffer in (
                "input_ids",
                "positions",
                "slot_mapping",
                "context_lens",
                "block_tables",
                "outputs",
            )
        )
        del llm, graphs
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()

    first = create_use_close()
    assert create_use_close() <= first  # a second engine leaves nothing more behind


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_graphs_match_one_rank(checkpoints):
    path = str(checkpoints["gqa"])
    prompts, params = graph_workload(seed=3)
    common = dict(F32, kvcache_block_size=BLOCK, max_num_seqs=40, num_kvcache_blocks=256)
    with LLM(path, **common) as llm:
        one_rank = token_ids(llm.generate(prompts, params, use_tqdm=False))
    with LLM(path, tensor_parallel_size=2, **common) as llm:
        two_ranks = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert two_ranks == one_rank


# -- compiled ops against eager ones ------------------------------------------------


def compiled_copy(fn):
    """torch.compile of a copy of `fn` with a code object of its own, so that these
    compilations neither reuse nor add to the cache (and recompile limit) of the compiled
    ops the engines share; fullgraph: no silent fallback to eager."""
    copy = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    return torch.compile(copy, fullgraph=True)


def op_cases(dtype: torch.dtype) -> list[tuple]:
    g = torch.Generator().manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to("cuda", dtype)

    cache = get_rope(128, 4096, {"rope_theta": 1e6}).cos_sin_cache.cuda()
    positions = torch.randint(0, 4096, (37,), generator=g).cuda()
    return [
        (rms_norm, (randn(37, 1024), randn(1024), 1e-6)),
        (rms_norm, (randn(37, 16, 128), randn(128), 1e-6)),
        (add_rms_norm, (randn(37, 1024), randn(37, 1024), randn(1024), 1e-6)),
        (silu_and_mul, (randn(37, 2 * 3072),)),
        (apply_rotary_emb, (positions, randn(37, 16, 128), randn(37, 8, 128), cache)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_ops_match_eager(dtype):
    """float32: the same math up to summation order. bfloat16: eager rounds its
    intermediate results, compiled code computes in float32 and rounds once, so they may
    differ by a couple of bfloat16 roundings (2**-8 each) at the output's scale."""
    for op, args in op_cases(dtype):
        eager, compiled = op.eager(*args), compiled_copy(op.eager)(*args)
        pairs = zip(eager, compiled) if isinstance(eager, tuple) else [(eager, compiled)]
        for e, c in pairs:
            e, c = e.float(), c.float()
            if dtype == torch.float32:
                torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
            else:
                torch.testing.assert_close(c, e, rtol=2**-6, atol=2**-6 * e.abs().max().item())


def test_compiled_softmax_race_draws_from_the_softmax_and_never_a_filtered_token():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    rows = 40000
    logits = probs.log().cuda().repeat(rows, 1)  # log 0 = -inf: filtered out
    drawn = compiled_copy(softmax_race.eager)(logits)
    counts = torch.bincount(drawn, minlength=5).cpu().double()
    assert counts[4] == 0
    expected = probs[:4].double() * rows
    chi2 = ((counts[:4] - expected) ** 2 / expected).sum().item()
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001
