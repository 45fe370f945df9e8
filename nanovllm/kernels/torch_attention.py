"""Paged attention in plain PyTorch on any device (shapes: attention.AttentionBackend): the
reference the Triton kernels are tested against, and the `torch` backend's compute. Prefill: one
SDPA per sequence over its chunk and cached prefix. Decode: SDPA over a dense copy of the K/V
rows in use, for a group of sequences (attention/torch_backend.py plans the groups)."""

import torch
import torch.nn.functional as F


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_q: list[int],
    seqlens_k: list[int],
    block_tables: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """block_tables None: no chunk has a cached prefix, keys are each chunk's own."""
    out = torch.empty_like(q)
    start = 0
    for i, (len_q, len_k) in enumerate(zip(seqlens_q, seqlens_k)):
        end = start + len_q
        if block_tables is None:
            k_i, v_i = k[start:end], v[start:end]
        else:
            k_i = gather_kv(k_cache, block_tables[i], len_k)
            v_i = gather_kv(v_cache, block_tables[i], len_k)
        out[start:end] = sdpa(q[start:end], k_i, v_i, scale)
        start = end
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [n, heads, dim] -> [n, heads, dim], one query per sequence over the cache rows
    `slots` [n, max_len] (padding: any valid slot) where `mask` [n, 1, 1, max_len] is True."""
    n, max_len = slots.shape
    # [n, num_kv_heads, max_len, head_dim]: a copy of only the rows in use (index_select,
    # not cache[slots]: several times faster on the CPU)
    k, v = (
        cache.flatten(0, 1)
        .index_select(0, slots.view(-1))
        .view(n, max_len, *cache.shape[2:])
        .transpose(1, 2)
        for cache in (k_cache, v_cache)
    )
    return _sdpa_gqa(q.unsqueeze(2), k, v, mask, scale).squeeze(2)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens' rows of one sequence: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence: q [len_q, heads, dim]; k, v [len_k, kv_heads, dim],
    len_k >= len_q; query j sits at position len_k - len_q + j and sees keys up to there."""
    len_q, len_k = q.shape[0], k.shape[0]
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if len_q == len_k:
        return _sdpa_gqa(q, k, v, None, scale, is_causal=True).transpose(0, 1)
    offset = len_k - len_q
    mask = (
        torch.arange(len_k, device=q.device)[None, :]
        <= torch.arange(offset, len_k, device=q.device)[:, None]
    )
    return _sdpa_gqa(q, k, v, mask, scale).transpose(0, 1)


def _sdpa_gqa(q, k, v, mask, scale, is_causal=False):
    """scaled_dot_product_attention where k/v may have fewer heads than q (GQA/MQA)."""
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[-3] != k.shape[-3],
    )
