"""store_kvcache: write each new token's K and V rows into its paged-cache slot.

    slot = block_id * block_size + offset     ->  k_cache[block_id, offset] = k[token]

A slot of -1 marks a padding token (a CUDA-graph batch padded to its captured size)
and writes nothing. No host sync: safe to capture in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.layout import assert_cache, assert_index, assert_rows


@triton.jit
def _store_kvcache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,  # k, v: [num_tokens, num_kv_heads, head_dim]
    stride_cb,
    stride_ct,
    stride_ch,  # caches: [blocks, block_size, kv_heads, dim]
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    cache_offsets = (
        (slot // block_size) * stride_cb
        + (slot % block_size) * stride_ct
        + heads * stride_ch
        + dims
    )
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + cache_offsets, k, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v, mask=mask)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; slot_mapping [num_tokens] int32/int64, -1 = skip.
    Slots must lie below num_blocks * block_size (the runner's invariant; not checked
    here, as that would need a host sync)."""
    assert_rows("k", k, 3)
    assert_rows("v", v, 3, like=k)
    assert v.shape == k.shape, f"v's shape {tuple(v.shape)} is not k's {tuple(k.shape)}"
    assert assert_cache(k_cache, v_cache, like=k) == k.shape[1], "k_cache's num_kv_heads is not k's"
    assert_index("slot_mapping", slot_mapping, 1, k.shape[0], k.device)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
