"""The paged attention kernels against the torch reference backend, on random caches
whose unused slots and outputs are NaN-poisoned: a read past a context or a row left
unwritten shows up as NaN."""

import pytest
import torch
from kernel_cases import (
    DEVICE,
    NAN,
    TOLERANCE,
    cu_seqlens,
    paged_cache,
    randn,
    rel_error,
    requires_kernels,
)

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchBackend

pytestmark = [pytest.mark.cuda, requires_kernels]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
NUM_KV_HEADS = 2


def case_id(case) -> str:
    dtype, group, head_dim, block_size, last = case
    return f"{str(dtype)[6:]}-gqa{group}-d{head_dim}-bs{block_size}-{last}"


# dtype, GQA group (query heads per KV head), head_dim, block_size, num_splits (None: auto)
DECODE_CASES = [
    (F32, 1, 64, 16, 1),
    (F32, 2, 128, 16, 3),
    (F32, 4, 64, 256, 1),
    (F32, 4, 128, 256, 2),
    (BF16, 2, 128, 256, 1),
    (BF16, 4, 64, 16, 4),
    (F16, 1, 128, 16, None),
    (F32, 2, 96, 16, 2),  # head_dim not a power of two: a masked, padded tile
]


def decode_context_lens(block_size: int) -> list[int]:
    """Exactly one block, a padding row (0), one token, a long ragged context, and one
    that ends exactly on a block boundary after several blocks."""
    return [block_size, 0, 1, max(2 * block_size, 200) + 3, 3 * block_size]


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_decode_matches_torch_reference(case):
    dtype, group, head_dim, block_size, num_splits = case
    from nanovllm.kernels import paged_decode_attention

    gen = torch.Generator().manual_seed(0)
    lens = decode_context_lens(block_size)
    cache = paged_cache(lens, NUM_KV_HEADS, head_dim, block_size, dtype, gen)
    q = randn(len(lens), NUM_KV_HEADS * group, head_dim, dtype=dtype, gen=gen, scale=2.0)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = torch.full_like(q, NAN)

    paged_decode_attention(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        context_lens,
        scale,
        num_splits=num_splits,
        out=out,
    )

    ctx = AttentionMetadata(block_tables=cache.block_tables, context_lens=context_lens)
    ref = TorchBackend().decode(q.float(), *cache.clean(), ctx, scale)
    real = context_lens > 0
    assert rel_error(out[real], ref[real]) < TOLERANCE[dtype]
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # padding: zeros, no NaN


# dtype, GQA group, head_dim, block_size, "prefix" (keys from the paged cache after a
# cached prefix) or "chunk" (no prefix: keys are the chunk's own k, v)
PREFILL_CASES = [
    (F32, 1, 128, 16, "chunk"),
    (F32, 2, 64, 16, "prefix"),
    (F32, 4, 128, 256, "prefix"),
    (BF16, 4, 64, 16, "chunk"),
    (BF16, 2, 128, 256, "prefix"),
    (F16, 1, 64, 256, "chunk"),
    (F32, 2, 96, 16, "prefix"),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=case_id)
def test_prefill_matches_torch_reference(case):
    dtype, group, head_dim, block_size, keys = case
    from nanovllm.kernels import paged_prefill_attention

    gen = torch.Generator().manual_seed(0)
    num_heads = NUM_KV_HEADS * group
    # sequence 0 ends exactly on a block boundary; 2 is one token; 3 spans two query tiles
    if keys == "prefix":
        prefix_lens, chunk_lens = [block_size, 5, 3, 0], [block_size, 9, 1, 70]
    else:
        prefix_lens, chunk_lens = [0, 0, 0, 0], [block_size, 9, 1, 70]
    seqlens_k = [p + c for p, c in zip(prefix_lens, chunk_lens)]
    num_tokens = sum(chunk_lens)
    # q, k, v as strided views of one qkv tensor, as the model passes them
    qkv = randn(
        num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, dtype=dtype, gen=gen, scale=1.5
    )
    q, k, v = qkv.split(
        [num_heads * head_dim, NUM_KV_HEADS * head_dim, NUM_KV_HEADS * head_dim], -1
    )
    q = q.view(num_tokens, num_heads, head_dim)
    k, v = k.view(num_tokens, NUM_KV_HEADS, head_dim), v.view(num_tokens, NUM_KV_HEADS, head_dim)
    if keys == "prefix":
        cache = paged_cache(seqlens_k, NUM_KV_HEADS, head_dim, block_size, dtype, gen)
        k_cache, v_cache, block_tables = cache.k_cache, cache.v_cache, cache.block_tables
        ref_caches = cache.clean()
        k, v = torch.full_like(k, NAN), torch.full_like(v, NAN)  # the paged path must not read them
    else:  # like the warmup: no cache at all
        k_cache = v_cache = torch.tensor([], device=DEVICE)
        block_tables, ref_caches = None, (None, None)
    cu_q, cu_k = cu_seqlens(chunk_lens), cu_seqlens(seqlens_k)
    scale = head_dim**-0.5
    out = torch.full_like(q, NAN)

    paged_prefill_attention(
        q, k, v, k_cache, v_cache, cu_q, cu_k, max(chunk_lens), block_tables, scale, out=out
    )

    ctx = AttentionMetadata(
        block_tables=block_tables,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max(chunk_lens),
        max_seqlen_k=max(seqlens_k),
        seqlens_q=chunk_lens,
        seqlens_k=seqlens_k,
    )
    ref = TorchBackend().prefill(q.float(), k.float(), v.float(), *ref_caches, ctx, scale)
    assert not out.isnan().any()
    assert rel_error(out, ref) < TOLERANCE[dtype]
