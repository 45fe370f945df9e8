"""flash_attn and triton backends agree (CUDA with flash-attn installed only)."""
import importlib.util

import pytest
import torch

from kernel_cases import DEVICE, cu_seqlens, paged_cache, randn, rel_error
from nanovllm.attention.metadata import AttentionMetadata

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    DEVICE != "cuda" or importlib.util.find_spec("flash_attn") is None,
    reason="needs CUDA (outside the interpreter) and flash-attn")]
BLOCK, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 256, 2, 8, 128


def backends():
    from nanovllm.attention.flash_backend import FlashAttnBackend
    from nanovllm.attention.triton_backend import TritonBackend
    return FlashAttnBackend(), TritonBackend()


def test_decode_agrees_with_triton():
    gen = torch.Generator().manual_seed(0)
    lens = [BLOCK, 1, 2 * BLOCK + 7, 700]
    cache = paged_cache(lens, NUM_KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16, gen)
    q = randn(len(lens), NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, gen=gen)
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ctx = AttentionMetadata(is_prefill=False, slot_mapping=context_lens,
                            block_tables=cache.block_tables, context_lens=context_lens)
    flash, triton = (b.decode(q, cache.k_cache, cache.v_cache, ctx, HEAD_DIM ** -0.5)
                     for b in backends())
    assert rel_error(triton, flash) < 1e-2


def test_prefill_with_cached_prefix_agrees_with_triton():
    gen = torch.Generator().manual_seed(1)
    prefix_lens, chunk_lens = [BLOCK, 3, 0], [BLOCK, 40, 300]
    seqlens_k = [p + c for p, c in zip(prefix_lens, chunk_lens)]
    cache = paged_cache(seqlens_k, NUM_KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16, gen)
    q = randn(sum(chunk_lens), NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, gen=gen)
    k = v = torch.empty(0, device="cuda")  # unused: the keys come from the cache
    cu_q, cu_k = cu_seqlens(chunk_lens), cu_seqlens(seqlens_k)
    ctx = AttentionMetadata(is_prefill=True, slot_mapping=cu_q, block_tables=cache.block_tables,
                            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(chunk_lens),
                            max_seqlen_k=max(seqlens_k), seqlens_q=chunk_lens, seqlens_k=seqlens_k)
    flash, triton = (b.prefill(q, k, v, cache.k_cache, cache.v_cache, ctx, HEAD_DIM ** -0.5)
                     for b in backends())
    assert rel_error(triton, flash) < 1e-2
