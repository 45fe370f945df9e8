"""Attention over the paged KV cache, behind one backend interface.

Each step, an attention layer (1) writes the new tokens' K/V into their cache slots
(`slot_mapping`, -1 = skip) and (2) attends:
  prefill  each sequence's chunk of queries over its keys (cached prefix + chunk), causal;
  decode   one query per sequence over its `context_lens` cached keys.

Backends live in their own modules: `torch` (torch_attention.py, the reference; runs
anywhere). The runner gives every Attention layer its backend and its cache slices.
"""
from typing import Protocol

import torch
from torch import nn

from nanovllm.layers.context import AttentionMetadata, get_context
from nanovllm.layers.torch_attention import TorchBackend


class AttentionBackend(Protocol):
    """What every backend implements. Shapes:
    q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; outputs are
    [num_tokens, num_heads, head_dim] (decode: one token per sequence)."""

    name: str

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, ctx: AttentionMetadata, scale: float) -> torch.Tensor: ...

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               ctx: AttentionMetadata, scale: float) -> torch.Tensor: ...


def select_backend(name: str, device: torch.device, block_size: int) -> AttentionBackend:
    """The backend for `attention_backend=name`; a ValueError says why one cannot run."""
    if name in ("auto", "torch"):
        return TorchBackend()
    raise ValueError(f"attention_backend {name!r} is not available in this build; use 'torch'")


class Attention(nn.Module):
    """The attention layer a model uses; the runner sets `backend`, `k_cache`, `v_cache`."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend: AttentionBackend = TorchBackend()
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if self.k_cache.numel():  # no cache yet during the memory-profiling warmup
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.is_prefill:
            return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, ctx, self.scale)
        return self.backend.decode(q, self.k_cache, self.v_cache, ctx, self.scale)
