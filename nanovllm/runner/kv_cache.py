"""The KV cache: its shape, how many blocks fit, and the memory arithmetic behind that.

    kv_cache [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]   (K, V)

Blocks: `num_kvcache_blocks` when the user sets it, else as many as a memory budget
holds (a CPU: `cpu_kvcache_space_gib`; CUDA: `kv_cache_budget` below), capped at what
max_num_seqs sequences of max_model_len tokens could ever use.

The CUDA budget, in bytes, from a profile taken after the warmup:

    within our cap   gpu_memory_utilization * total - peak - graph_pool
    actually free    free - (peak - current) - graph_pool
    budget           max(0, min(within our cap, actually free))

`peak` is this process's own peak use (weights, the largest prefill's activations, the
sampler's [rows, vocab] temporaries, and device memory outside PyTorch's allocator that
appeared since the runner started: NCCL buffers, loaded kernels); `current` is what it
holds now, so `peak - current` is the activation memory it will need again. Other
processes' memory is never subtracted from our cap, only from what is free, so it can
shrink the cache but never make the arithmetic go negative. The CUDA context itself
(there before the runner starts) is not counted: gpu_memory_utilization's headroom
covers it. `graph_pool`: the decode CUDA graphs' memory, captured after the cache.
"""
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanovllm.layers.attention import Attention, AttentionBackend


class MemoryProfile(NamedTuple):
    """Device memory in bytes, as kv_cache_budget reads it."""
    total: int       # the device's
    free: int        # free on the device now (all processes)
    peak: int        # this process's peak use
    current: int     # this process's use now
    graph_pool: int  # still to come: the CUDA graphs' pool (0 without graphs)


def kv_cache_budget(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Bytes the KV cache may take: within our cap, never more than is free (see the
    module docstring); 0 when nothing is left."""
    p = profile
    within_cap = gpu_memory_utilization * p.total - p.peak - p.graph_pool
    actually_free = p.free - (p.peak - p.current) - p.graph_pool
    return max(0, int(min(within_cap, actually_free)))


def num_blocks_within(budget: int, bytes_per_block: int, hint: str) -> int:
    """Whole blocks in `budget` bytes; a ValueError ending in `hint` (what to change)
    when not even one fits."""
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"no memory is left for even one KV-cache block ({bytes_per_block} "
                         f"bytes; {budget} bytes left); {hint}")
    return num_blocks


def kv_cache_shape(layers: list[Attention], num_blocks: int, block_size: int) -> tuple[int, ...]:
    attn = layers[0]
    return (2, len(layers), num_blocks, block_size, attn.num_kv_heads, attn.head_dim)


def bytes_per_block(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    return math.prod(kv_cache_shape(layers, 1, block_size)) * dtype.itemsize


def bind_kv_cache(layers: list[Attention], kv_cache: torch.Tensor | None,
                  backend: AttentionBackend) -> None:
    """Give each attention layer its slices of `kv_cache` (None: no cache)."""
    for i, layer in enumerate(layers):
        if kv_cache is None:
            layer.k_cache = layer.v_cache = torch.tensor([])
        else:
            layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
        layer.backend = backend


@dataclass(frozen=True, slots=True)
class CudaMemoryBaseline:
    """Device memory outside PyTorch's allocator when the runner starts (the CUDA
    context, other processes), so that what appears later can be counted as ours."""
    device: torch.device
    untracked: int

    @classmethod
    def take(cls, device: torch.device) -> "CudaMemoryBaseline":
        free, total = torch.cuda.mem_get_info(device)
        return cls(device, total - free - torch.cuda.memory_reserved(device))

    def profile(self, peak_reserved: int, graph_pool: int) -> MemoryProfile:
        """After the warmup, whose peak of PyTorch-reserved memory is `peak_reserved`.
        Empties PyTorch's cache first: `free` then includes the activations' memory,
        which `peak - current` reserves again."""
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        untracked_growth = max(0, total - free - reserved - self.untracked)
        return MemoryProfile(total=total, free=free, peak=peak_reserved + untracked_growth,
                             current=reserved + untracked_growth, graph_pool=graph_pool)
