"""The `torch` attention backend: plain PyTorch, runs on any device. It gathers each
sequence's keys from its block table and calls scaled_dot_product_attention; it is the
reference the Triton kernels are tested against, and the CPU path."""
import torch
import torch.nn.functional as F

from nanovllm.layers.context import AttentionMetadata

_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class TorchBackend:
    """Reference attention in plain PyTorch (see AttentionBackend for the shapes)."""

    name = "torch"

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if bool((slot_mapping < 0).any()):
            keep = slot_mapping >= 0
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, ctx: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for i, (len_q, len_k) in enumerate(zip(ctx.seqlens_q, ctx.seqlens_k)):
            end = start + len_q
            if ctx.block_tables is None:  # no cached prefix: keys are this chunk's own
                k_i, v_i = k[start:end], v[start:end]
            else:
                k_i = gather_kv(k_cache, ctx.block_tables[i], len_k)
                v_i = gather_kv(v_cache, ctx.block_tables[i], len_k)
            out[start:end] = sdpa(q[start:end], k_i, v_i, scale)
            start = end
        return out

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               ctx: AttentionMetadata, scale: float) -> torch.Tensor:
        num_seqs, num_blocks = ctx.block_tables.shape
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        max_len = num_blocks * block_size
        block_tables = ctx.block_tables.clamp_min(0)  # padding reads block 0, masked below
        # [num_seqs, num_kv_heads, max_len, head_dim]
        k = k_cache[block_tables].view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache[block_tables].view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
        valid = torch.arange(max_len, device=q.device) < ctx.context_lens[:, None]
        out = _sdpa_gqa(q.unsqueeze(2), k, v, valid[:, None, None, :], scale)
        return out.squeeze(2)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens' rows of one sequence: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size]
    return cache[blocks].flatten(0, 1)[:length]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence whose queries are its last len(q) positions.

    q [len_q, heads, dim]; k, v [len_k, kv_heads, dim] with len_k >= len_q.
    Query j sits at position len_k - len_q + j and sees keys up to there.
    """
    len_q, len_k = q.shape[0], k.shape[0]
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if len_q == len_k:
        return _sdpa_gqa(q, k, v, None, scale, is_causal=True).transpose(0, 1)
    offset = len_k - len_q
    mask = (torch.arange(len_k, device=q.device)[None, :]
            <= torch.arange(offset, len_k, device=q.device)[:, None])
    return _sdpa_gqa(q, k, v, mask, scale).transpose(0, 1)


def _sdpa_gqa(q, k, v, mask, scale, is_causal=False):
    """scaled_dot_product_attention where k/v may have fewer heads than q (GQA/MQA)."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1 and not _SDPA_HAS_GQA:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    extra = {"enable_gqa": True} if group > 1 and _SDPA_HAS_GQA else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          scale=scale, **extra)
