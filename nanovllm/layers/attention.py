"""The attention layer a model uses: stores the step's new K/V in its slice of the paged
cache, then attends through the backend (nanovllm/attention)."""
import torch
from torch import nn

from nanovllm.attention import AttentionBackend, get_context


class Attention(nn.Module):
    """The runner binds `backend`, `k_cache` and `v_cache` (bind_kv_cache) before a step."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend: AttentionBackend | None = None
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if self.k_cache.numel():  # no cache yet during the memory-profiling warmup
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.is_prefill:
            return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, ctx, self.scale)
        return self.backend.decode(q, self.k_cache, self.v_cache, ctx, self.scale)
