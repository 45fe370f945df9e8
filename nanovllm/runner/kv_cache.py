"""The KV cache: its shape, how many blocks a budget holds, its binding to the layers. (The
budget is the platform's: on CUDA it is measured, platforms/cuda/memory.py.)

    kv_cache [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]   (K, V)
"""

import torch

from nanovllm.layers.attention import Attention


def kv_cache_shape(layers: list[Attention], num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (2, len(layers), num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)


def num_blocks_within(budget: int, bytes_per_block: int, hint: str) -> int:
    """Whole blocks in `budget` bytes; a ValueError ending in `hint` when not even one fits."""
    if budget < bytes_per_block:
        raise ValueError(
            f"no memory is left for even one KV-cache block ({bytes_per_block} "
            f"bytes; {budget} bytes left); {hint}"
        )
    return budget // bytes_per_block


def bind_kv_cache(layers: list[Attention], kv_cache: torch.Tensor | None) -> None:
    """Give each attention layer its K and V slices of `kv_cache` (None: empty ones)."""
    kv_cache = torch.empty(2, len(layers), 0) if kv_cache is None else kv_cache
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv_cache[:, i]
