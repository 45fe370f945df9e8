"""The attention layer: stores the step's new K/V in its cache, attends through the backend."""

import torch
from torch import nn

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import get_context


class Attention(nn.Module):
    """The runner binds `backend`, `k_cache` and `v_cache` (bind_kv_cache) before a step."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        self.backend: AttentionBackend | None = None
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Decode rows, then prefill chunks, once every new K/V is in the cache."""
        ctx = get_context()
        if self.k_cache.numel():  # no cache yet during the memory-profiling warmup
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        n = ctx.num_decode_tokens
        if ctx.decode is not None:
            decoded = self.backend.decode(q[:n], self.k_cache, self.v_cache, ctx.decode, self.scale)
            if ctx.prefill is None:
                return decoded
        prefilled = self.backend.prefill(
            q[n:], k[n:], v[n:], self.k_cache, self.v_cache, ctx.prefill, self.scale
        )
        return prefilled if ctx.decode is None else torch.cat((decoded, prefilled))
