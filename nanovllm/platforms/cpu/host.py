"""The host a CPU run computes on: what precision it computes natively (dtype="auto" takes
float32 where the checkpoint's half precision is only emulated), its RAM, and glibc's habit of
giving freed memory back (docs/cpu.md has the measurements behind each)."""

import ctypes
import ctypes.util
import logging
import os
from typing import NamedTuple

import torch
from torch import nn

from nanovllm.config import Config

logger = logging.getLogger("nanovllm")


# The CPU flags (/proc/cpuinfo) of native arithmetic in each half-precision dtype.
_NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


class DtypeChoice(NamedTuple):
    dtype: str
    reason: str


def choose_cpu_dtype(
    checkpoint: str, flags: frozenset[str], float32_bytes: int, memory_bytes: int
) -> DtypeChoice:
    """The checkpoint's half-precision dtype where the CPU computes it natively, else
    float32 (emulated bf16/fp16 is slower: docs/cpu.md) when it fits in 80% of `memory_bytes`."""
    native = [f for f in _NATIVE_FLAGS.get(checkpoint, ()) if f in flags]
    if native or checkpoint not in _NATIVE_FLAGS:
        return DtypeChoice(
            checkpoint,
            f"the checkpoint's; native here ({', '.join(native)})"
            if native
            else "the checkpoint's",
        )
    need, have = f"{float32_bytes / 2**30:.1f} GiB", f"{0.8 * memory_bytes / 2**30:.1f} GiB"
    if float32_bytes <= 0.8 * memory_bytes:
        return DtypeChoice(
            "float32",
            f"no {' or '.join(_NATIVE_FLAGS[checkpoint])}: "
            f"{checkpoint} is emulated; float32 model + KV cache {need} fit {have}",
        )
    return DtypeChoice(
        checkpoint,
        f"{checkpoint} is emulated here, but float32 model + KV cache "
        f"({need}) would not fit in {have}; pass dtype='float32' to force it",
    )


def cpu_flags() -> frozenset[str]:
    """From /proc/cpuinfo; empty where it lists none."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith("flags")), ":")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def physical_memory() -> int:
    """Bytes of RAM: the same on every rank, so tensor-parallel ranks choose alike."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def keep_freed_host_memory() -> bool:
    """glibc returns each large tensor's memory to the OS when it is freed (mmap'd above 128
    KiB-32 MiB), so the next one page-faults its way in again: on a CPU that made elementwise
    ops over a prefill's activations several times slower than their arithmetic (docs/cpu.md).
    Keep freed memory in the heap for reuse (what tcmalloc or jemalloc, which vLLM's CPU build
    asks for, do).
    Process-wide; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 2**30) and mallopt(m_trim_threshold, 2**31 - 1))


def auto_dtype(checkpoint: str, config: Config, model_class: type[nn.Module]) -> str:
    """dtype="auto" on a CPU: the checkpoint's dtype, or float32 for a half precision that this
    CPU only emulates (choose_cpu_dtype), logged with the reason."""
    if checkpoint not in _NATIVE_FLAGS:
        return checkpoint
    need = float32_bytes(config, model_class)
    choice = choose_cpu_dtype(checkpoint, cpu_flags(), need, physical_memory())
    logger.info("dtype=auto on this CPU: %s (%s)", choice.dtype, choice.reason)
    return choice.dtype


def float32_bytes(config: Config, model_class: type[nn.Module]) -> int:
    """The model in float32 (counted on the meta device) and every rank's KV cache."""
    with torch.device("meta"):
        model = model_class(config.hf_config)
    kv_bytes = config.tensor_parallel_size * config.cpu_kvcache_space_gib * 2**30
    return 4 * sum(p.numel() for p in model.parameters()) + int(kv_bytes)
