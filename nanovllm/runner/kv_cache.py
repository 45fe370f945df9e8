"""The KV cache: its shape, how many blocks fit (README, "CUDA", says why), its binding.

kv_cache [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]   (K, V)
"""

from typing import NamedTuple

import torch

from nanovllm.layers.attention import Attention


class MemoryProfile(NamedTuple):
    """Device memory in bytes, as kv_cache_budget reads it."""

    total: int  # the device's
    free: int  # free on the device now (all processes)
    peak: int  # this process's peak use
    current: int  # this process's use now
    graph_pool: int  # still to come: the CUDA graphs' pool (0 without graphs)


SAFETY_MARGIN = 256 * 2**20  # allocator fragmentation: a cache sized to the byte can OOM


def kv_cache_budget(p: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Bytes the KV cache may take, SAFETY_MARGIN kept free; 0 when nothing is left.
    `peak - current` is activation memory needed again; other processes' memory only
    lowers `free`, so it can shrink the cache but never make the arithmetic negative."""
    within_cap = gpu_memory_utilization * p.total - p.peak - p.graph_pool - SAFETY_MARGIN
    actually_free = p.free - (p.peak - p.current) - p.graph_pool - SAFETY_MARGIN
    return max(0, int(min(within_cap, actually_free)))


def untracked_cuda_memory(device: torch.device) -> int:
    """Device memory in use outside PyTorch's allocator (the CUDA context, other processes)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def num_blocks_within(budget: int, bytes_per_block: int, hint: str) -> int:
    """Whole blocks in `budget` bytes; a ValueError ending in `hint` when not even one fits."""
    if budget < bytes_per_block:
        raise ValueError(
            f"no memory is left for even one KV-cache block ({bytes_per_block} "
            f"bytes; {budget} bytes left); {hint}"
        )
    return budget // bytes_per_block


def kv_cache_shape(layers: list[Attention], num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (2, len(layers), num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)


def bind_kv_cache(layers: list[Attention], kv_cache: torch.Tensor | None) -> None:
    """Give each attention layer its K and V slices of `kv_cache` (None: empty ones)."""
    kv_cache = torch.empty(2, len(layers), 0) if kv_cache is None else kv_cache
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv_cache[:, i]
