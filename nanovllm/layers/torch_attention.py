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

    def __init__(self) -> None:
        self._decode_step: tuple[AttentionMetadata, tuple[torch.Tensor, torch.Tensor]] | None = None

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
        slots, valid = self._decode_slots(ctx, k_cache.shape[1])
        num_seqs, max_len = slots.shape
        # [num_seqs, num_kv_heads, max_len, head_dim]: a copy of only the rows in use
        k = _rows(k_cache, slots.view(-1)).view(num_seqs, max_len, *k_cache.shape[2:]).transpose(1, 2)
        v = _rows(v_cache, slots.view(-1)).view(num_seqs, max_len, *v_cache.shape[2:]).transpose(1, 2)
        return _sdpa_gqa(q.unsqueeze(2), k, v, valid, scale).squeeze(2)

    def _decode_slots(self, ctx: AttentionMetadata, block_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache slot of every context token, [num_seqs, max_len] (padding reads slot
        0), and the mask of real ones, [num_seqs, 1, 1, max_len]. Computed once per step
        (the metadata object) and reused by every layer."""
        if self._decode_step is not None and self._decode_step[0] is ctx:
            return self._decode_step[1]
        lens = ctx.context_lens
        # On the CPU trim to the longest context; elsewhere keep the shape static (no
        # host sync, so the step can be captured in a CUDA graph).
        max_len = (int(lens.max()) if lens.device.type == "cpu"
                   else ctx.block_tables.shape[1] * block_size)
        pos = torch.arange(max_len, device=lens.device)
        blocks = ctx.block_tables.index_select(1, pos // block_size).long()
        valid = pos < lens[:, None]
        slots = (blocks * block_size + pos % block_size).masked_fill_(~valid, 0)
        self._decode_step = (ctx, (slots, valid[:, None, None, :]))
        return self._decode_step[1]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens' rows of one sequence: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def _rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, ...] rows at flat slots: [len(slots), ...].
    index_select, not cache[slots]: on the CPU it is several times faster."""
    return cache.flatten(0, 1).index_select(0, slots)


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
