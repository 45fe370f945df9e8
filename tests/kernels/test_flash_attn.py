"""The flash_attn backend against attention written out in float64 (CUDA with flash-attn
installed only)."""

import importlib.util

import pytest
import torch
from kernel_cases import (
    DEVICE,
    TOLERANCE,
    attention_written_out,
    cu_seqlens,
    paged_cache,
    randn,
    rel_error,
)

from nanovllm.attention.metadata import AttentionMetadata

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE != "cuda" or importlib.util.find_spec("flash_attn") is None,
        reason="needs CUDA (outside the interpreter) and flash-attn",
    ),
]
BLOCK, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 256, 2, 8, 128
BF16 = torch.bfloat16


def flash_backend():
    from nanovllm.attention.flash_attn_backend import FlashAttnBackend

    return FlashAttnBackend()


def test_decode_equals_attention_written_out():
    gen = torch.Generator().manual_seed(0)
    lens = [BLOCK, 1, 2 * BLOCK + 7, 700]
    cache = paged_cache(lens, NUM_KV_HEADS, HEAD_DIM, BLOCK, BF16, gen)
    q = randn(len(lens), NUM_HEADS, HEAD_DIM, dtype=BF16, gen=gen)
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ctx = AttentionMetadata(block_tables=cache.block_tables, context_lens=context_lens)
    scale = HEAD_DIM**-0.5

    out = flash_backend().decode(q, cache.k_cache, cache.v_cache, ctx, scale)

    ref = torch.cat(
        [
            attention_written_out(q[i : i + 1], *cache.context(i, n), scale)
            for i, n in enumerate(lens)
        ]
    )
    assert rel_error(out, ref) < TOLERANCE[BF16]


def test_prefill_with_cached_prefix_equals_attention_written_out():
    gen = torch.Generator().manual_seed(1)
    prefix_lens, chunk_lens = [BLOCK, 3, 0], [BLOCK, 40, 300]
    seqlens_k = [p + c for p, c in zip(prefix_lens, chunk_lens)]
    cache = paged_cache(seqlens_k, NUM_KV_HEADS, HEAD_DIM, BLOCK, BF16, gen)
    q = randn(sum(chunk_lens), NUM_HEADS, HEAD_DIM, dtype=BF16, gen=gen)
    k = v = torch.empty(0, device="cuda")  # unused: the keys come from the cache
    cu_q, cu_k = cu_seqlens(chunk_lens), cu_seqlens(seqlens_k)
    ctx = AttentionMetadata(
        block_tables=cache.block_tables,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max(chunk_lens),
        max_seqlen_k=max(seqlens_k),
        seqlens_q=chunk_lens,
        seqlens_k=seqlens_k,
    )
    scale = HEAD_DIM**-0.5

    out = flash_backend().prefill(q, k, v, cache.k_cache, cache.v_cache, ctx, scale)

    starts = cu_q.tolist()
    ref = torch.cat(
        [
            attention_written_out(q[starts[i] : starts[i + 1]], *cache.context(i, n), scale)
            for i, n in enumerate(seqlens_k)
        ]
    )
    assert rel_error(out, ref) < TOLERANCE[BF16]
