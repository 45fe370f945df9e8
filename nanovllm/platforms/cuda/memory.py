"""A CUDA run's memory: before its KV cache exists, the measurements that size it (docs/cuda.md
says why each term is there); each step, its host-built inputs copied to the device without a
sync (on_device).

    budget = min(gpu_memory_utilization * total - peak - graph_pool,
                 free - (peak - current) - graph_pool) - SAFETY_MARGIN

(kv_cache_budget). peak and current are this process's own use: PyTorch's reserved memory
plus what appeared outside it since start-up (NCCL buffers, kernels). Other processes' memory
only lowers `free`: it can shrink the cache, never drive the arithmetic negative."""

from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace
from typing import NamedTuple, TypeVar

import torch

from nanovllm.device import to_device
from nanovllm.platforms.cuda.graphs import CUDAGraphRunner
from nanovllm.platforms.interface import MemorySizing

T = TypeVar("T")


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
    `peak - current` is activation memory needed again."""
    within_cap = gpu_memory_utilization * p.total - p.peak - p.graph_pool - SAFETY_MARGIN
    actually_free = p.free - (p.peak - p.current) - p.graph_pool - SAFETY_MARGIN
    return max(0, int(min(within_cap, actually_free)))


def untracked_memory(device: torch.device) -> int:
    """Device memory in use outside PyTorch's allocator (the CUDA context, other processes)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def measure_kv_cache_budget(
    sizing: MemorySizing, device: torch.device, untracked_at_start: int, utilization: float
) -> int:
    """Bytes left for the KV cache after the graphs' pool (a trial capture) and a profile run.
    PyTorch's cache is emptied first, so `free` includes the activations' memory."""
    graph_pool = 0
    if isinstance(sizing.fast_decode, CUDAGraphRunner):
        with sizing.trial_kv_cache():  # all padding: one block will do
            graph_pool = measure_graph_pool(sizing.fast_decode)
    peak = peak_memory_of(sizing.profile_run, device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    grown = max(0, total - free - reserved - untracked_at_start)  # outside PyTorch
    profile = MemoryProfile(total, free, peak + grown, reserved + grown, graph_pool)
    return kv_cache_budget(profile, utilization)


@torch.inference_mode()
def measure_graph_pool(graphs: CUDAGraphRunner) -> int:
    """Bytes the decode graphs' pool will take, before the KV cache is sized: the largest size
    captured on trial (every row padding: any KV cache will do), released again."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(graphs.device)
    graphs.pool = torch.cuda.graph_pool_handle()
    graph = graphs.capture_size(graphs.batch_sizes[-1])
    used = torch.cuda.memory_reserved(graphs.device) - before
    graph.reset()
    graphs.pool = None
    torch.cuda.empty_cache()
    return max(0, used)


def peak_memory_of(run: Callable[[], None], device: torch.device) -> int:
    """The peak PyTorch-reserved memory while `run()` runs, from an emptied cache."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_reserved(device)


def on_device(inputs: T, device: torch.device) -> T:
    """Host-built inputs with every tensor copied to `device` (in the NamedTuple, and in the
    dataclasses it holds, nested): from pinned memory, non-blocking, queued behind the device's
    work."""
    if isinstance(inputs, torch.Tensor):
        return to_device(inputs, device)
    if isinstance(inputs, tuple):  # a NamedTuple (StepInputs)
        return type(inputs)(*(on_device(value, device) for value in inputs))
    if is_dataclass(inputs):  # ForwardContext, AttentionMetadata
        moved = {f.name: on_device(getattr(inputs, f.name), device) for f in fields(inputs)}
        return replace(inputs, **moved)
    return inputs  # None, ints, lists of ints
