"""The torch attention backend (the CPU path, and the reference the Triton kernels are
tested against) against attention written out by hand in float64: decode both ways it
runs on a CPU (the native paged kernel, kernels/cpu_decode.py, and the gathering
reference), prefill after a cached prefix; the kernel against the reference in bfloat16;
and, end to end, a batch larger than one decode group against transformers."""

import tempfile
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, native_library

from nanovllm import LLM, SamplingParams
from nanovllm.attention.gathered_decode import DECODE_GROUP_SIZE
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.kernels import cpu_build, cpu_decode


def naive_decode(q, keys, values, scale):
    """One query per sequence over its own keys, in float64: q [heads, dim];
    keys, values [len, kv_heads, dim]."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [len, heads, dim]
    v = values.double().repeat_interleave(group, dim=1)
    weights = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", weights, v)


def naive_prefill(q, keys, values, scale):
    """A chunk of len(q) queries, the sequence's last positions, over its keys in float64,
    causal: q [len_q, heads, dim]; keys, values [len_k, kv_heads, dim]."""
    offset = keys.shape[0] - q.shape[0]
    return torch.stack(
        [
            naive_decode(q[j], keys[: offset + j + 1], values[: offset + j + 1], scale)
            for j in range(q.shape[0])
        ]
    )


def paged_batch(lengths, block_size=4, num_kv_heads=2, head_dim=8, seed=0, dtype=torch.float32):
    """A cache whose blocks are handed out in shuffled order, and the metadata of one
    decode step over sequences of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    ctx = AttentionMetadata(
        block_tables=block_tables, context_lens=torch.tensor(lengths, dtype=torch.int32)
    )
    return k_cache, v_cache, tables, ctx


def keys_of(cache, table, length):
    return cache[torch.tensor(table)].flatten(0, 1)[:length]


def cu_seqlens(lengths):
    """[0, l0, l0 + l1, ...] int32."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.fixture
def cpu_decode_library():
    return native_library(cpu_decode.load)


native = pytest.mark.usefixtures("cpu_decode_library")  # skipped only where no compiler exists


@pytest.fixture(params=["native", "gathering"])
def backend(request):
    if request.param == "native":
        native_library(cpu_decode.load)
    return TorchBackend(native_cpu_decode=request.param == "native")


@pytest.mark.parametrize(
    "lengths,num_heads,num_kv_heads,head_dim",
    [
        ([5], 4, 2, 8),  # one sequence
        ([1, 4, 9, 3], 4, 2, 8),  # fewer than a group, in batch order
        ([(7 * i) % 37 + 1 for i in range(DECODE_GROUP_SIZE * 2 + 3)], 4, 2, 8),  # sorted groups
        ([4, 8, 1, 12, 3, 5], 8, 1, 16),  # MQA; lengths on and off block edges
        ([1, 2, 3], 6, 6, 8),  # no GQA
        ([33, 7, 64], 16, 8, 128),  # Qwen3-0.6B's heads, several blocks
    ],
)
def test_decode_equals_attention_written_out(backend, lengths, num_heads, num_kv_heads, head_dim):
    k_cache, v_cache, tables, ctx = paged_batch(
        lengths, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    q = torch.randn(len(lengths), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    out = backend.decode(q, k_cache, v_cache, ctx, scale=0.3)
    for i, n in enumerate(lengths):
        expected = naive_decode(
            q[i], keys_of(k_cache, tables[i], n), keys_of(v_cache, tables[i], n), 0.3
        )
        assert torch.allclose(out[i].double(), expected, atol=1e-5), f"sequence {i} (length {n})"


def test_prefill_after_a_cached_prefix_equals_attention_written_out():
    # prefixes of one whole block (of 4), one and a bit, none, two and a bit; ragged chunks
    prefix_lens, chunk_lens = [4, 5, 0, 9], [3, 1, 6, 5]
    seqlens_k = [p + c for p, c in zip(prefix_lens, chunk_lens)]
    k_cache, v_cache, tables, decode_ctx = paged_batch(seqlens_k)  # every slot holds K/V
    q = torch.randn(sum(chunk_lens), 4, 8, generator=torch.Generator().manual_seed(1))
    unused = torch.full((sum(chunk_lens), 2, 8), float("nan"))  # keys come from the cache
    ctx = AttentionMetadata(
        block_tables=decode_ctx.block_tables,
        cu_seqlens_q=cu_seqlens(chunk_lens),
        cu_seqlens_k=cu_seqlens(seqlens_k),
        max_seqlen_q=max(chunk_lens),
        max_seqlen_k=max(seqlens_k),
        seqlens_q=chunk_lens,
        seqlens_k=seqlens_k,
    )
    out = TorchBackend().prefill(q, unused, unused, k_cache, v_cache, ctx, scale=0.3)
    starts = cu_seqlens(chunk_lens).tolist()
    for i, n in enumerate(seqlens_k):
        rows = slice(starts[i], starts[i + 1])
        expected = naive_prefill(
            q[rows], keys_of(k_cache, tables[i], n), keys_of(v_cache, tables[i], n), 0.3
        )
        assert torch.allclose(out[rows].double(), expected, atol=1e-5), f"sequence {i}"


@native
def test_native_decode_reads_a_bfloat16_cache_as_the_reference_does():
    lengths = [17, 1, 40, 16]
    k_cache, v_cache, _, ctx = paged_batch(
        lengths, block_size=16, head_dim=64, dtype=torch.bfloat16
    )
    q = torch.randn(len(lengths), 4, 64).to(torch.bfloat16)
    native = TorchBackend().decode(q, k_cache, v_cache, ctx, scale=0.125)
    reference = TorchBackend(native_cpu_decode=False).decode(q, k_cache, v_cache, ctx, scale=0.125)
    assert native.dtype == torch.bfloat16
    assert torch.allclose(native.float(), reference.float(), atol=2e-2)  # a bf16 rounding or two


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize(
    "head_dim,group",
    [(64, 1), (64, 2), (64, 4), (128, 1), (128, 2), (128, 4), (40, 3), (16, 2), (32, 4)],
)
def test_native_decode_over_block_sizes_head_dims_and_groups(dtype, block_size, head_dim, group):
    """The kernel's paths: head_dims it compiles for (16..256) and any other (40: a 16-wide
    chunk and a tail), heads two at a time and an odd one left, 8-row tiles and the rows
    left, one and several blocks a sequence; a bfloat16 cache read exactly (float32 q)."""
    lengths = [1, 3, 16, 17, 300]
    k_cache, v_cache, tables, ctx = paged_batch(
        lengths, block_size=block_size, num_kv_heads=2, head_dim=head_dim, dtype=dtype
    )
    q = torch.randn(len(lengths), 2 * group, head_dim, generator=torch.Generator().manual_seed(1))
    out = cpu_decode.paged_decode(
        cpu_decode.load(), q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, 0.1
    )
    for i, n in enumerate(lengths):
        expected = naive_decode(
            q[i], keys_of(k_cache, tables[i], n), keys_of(v_cache, tables[i], n), 0.1
        )
        assert torch.allclose(out[i].double(), expected, atol=1e-5), f"sequence {i} (length {n})"


@native
def test_native_decode_is_the_same_on_two_threads():
    lengths = [(13 * i) % 70 + 1 for i in range(9)]
    k_cache, v_cache, _, ctx = paged_batch(
        lengths, block_size=16, head_dim=64, dtype=torch.bfloat16
    )
    q = torch.randn(len(lengths), 4, 64)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(
                cpu_decode.paged_decode(
                    cpu_decode.load(),
                    q,
                    k_cache,
                    v_cache,
                    ctx.block_tables,
                    ctx.context_lens,
                    0.125,
                )
            )
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_without_a_compiler_decode_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpu_decode.load.cache_clear()
    monkeypatch.setattr(cpu_build, "_cache_dir", lambda: Path(tempfile.mkdtemp()))
    try:
        assert cpu_decode.load() is None
        assert "kernels of cpu_decode.cpp are unavailable" in caplog.text
        k_cache, v_cache, tables, ctx = paged_batch([6, 2])
        q = torch.randn(2, 4, 8)
        out = TorchBackend().decode(q, k_cache, v_cache, ctx, scale=0.5)
        expected = naive_decode(
            q[0], keys_of(k_cache, tables[0], 6), keys_of(v_cache, tables[0], 6), 0.5
        )
        assert torch.allclose(out[0].double(), expected, atol=1e-5)
    finally:
        cpu_decode.load.cache_clear()


def test_every_layer_of_a_step_reads_its_own_cache(backend):
    """The per-step gather plan is shared by the layers; their caches are not."""
    lengths = [3, 11, 6] * DECODE_GROUP_SIZE
    k_cache, v_cache, tables, ctx = paged_batch(lengths)
    q = torch.randn(len(lengths), 4, 8)
    backend.decode(q, k_cache, v_cache, ctx, scale=1.0)  # layer 0 plans the step
    out = backend.decode(q, 2 * k_cache, -v_cache, ctx, scale=1.0)
    expected = naive_decode(
        q[1], 2 * keys_of(k_cache, tables[1], 11), -keys_of(v_cache, tables[1], 11), 1.0
    )
    assert torch.allclose(out[1].double(), expected, atol=1e-5)


def test_greedy_batch_of_several_decode_groups_matches_transformers(checkpoints):
    g = torch.Generator().manual_seed(3)
    lengths = [int(n) for n in torch.randint(1, 60, (DECODE_GROUP_SIZE + 3,), generator=g)]
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(checkpoints["gqa"]), kvcache_block_size=16, num_kvcache_blocks=128) as llm:
        ours = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == [hf_greedy(str(checkpoints["gqa"]), tuple(p), 12) for p in prompts]
