"""Which device and dtype a runner uses, and host -> device copies that do not sync."""

import ctypes
import ctypes.util
import logging
import os
from typing import NamedTuple

import numpy as np
import torch

from nanovllm.distributed.launch import Torchrun
from nanovllm.models.hf_config import checkpoint_dtype

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, launch: Torchrun | None, rank: int, world_size: int) -> torch.device:
    """A rank's device: the CPU, or a GPU: number `rank` of this machine's (torchrun's
    LOCAL_RANK under torchrun), the current one for a single rank."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is unavailable; use 'cpu' or 'auto'")
    index, need = (
        (rank, world_size) if launch is None else (launch.local_rank, launch.local_rank + 1)
    )
    if need > torch.cuda.device_count():
        raise ValueError(
            f"{need} GPUs are needed here (one per rank: tensor_parallel_size, or "
            f"torchrun's ranks per node) but {torch.cuda.device_count()} are visible; "
            "start fewer ranks or use device='cpu'"
        )
    return (
        torch.device("cuda") if launch is None and world_size == 1 else torch.device("cuda", index)
    )


def resolve_dtype(
    name: str, hf_config, device: torch.device | None = None, float32_bytes: int = 0
) -> torch.dtype:
    """An explicit dtype is obeyed; "auto" is the checkpoint's, except on a CPU that only
    emulates it (choose_cpu_dtype). `float32_bytes`: the float32 model and KV cache."""
    if name == "auto":
        name = checkpoint_dtype(hf_config)
        if device is not None and device.type == "cpu" and name in _NATIVE_FLAGS:
            name, why = choose_cpu_dtype(name, cpu_flags(), float32_bytes, physical_memory())
            logging.getLogger("nanovllm").info("dtype=auto on this CPU: %s (%s)", name, why)
    if name not in _DTYPES:
        raise ValueError(
            f"checkpoint dtype {name!r} is not supported; pass dtype= one of {', '.join(_DTYPES)}"
        )
    return _DTYPES[name]


# The CPU flags (/proc/cpuinfo) of native arithmetic in each half-precision dtype.
_NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


class DtypeChoice(NamedTuple):
    dtype: str
    reason: str


def choose_cpu_dtype(
    checkpoint: str, flags: frozenset[str], float32_bytes: int, memory_bytes: int
) -> DtypeChoice:
    """The checkpoint's half-precision dtype where the CPU computes it natively, else
    float32 (emulated bf16/fp16 is ~2x slower) when it fits in 80% of `memory_bytes`."""
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
    ops over a prefill's activations ~7x slower than their arithmetic. Keep freed memory in
    the heap for reuse (what tcmalloc or jemalloc, which vLLM's CPU build asks for, do).
    Process-wide; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 2**30) and mallopt(m_trim_threshold, 2**31 - 1))


def list_to_device(data: list, device: torch.device) -> torch.Tensor:
    """torch.tensor(data) on `device`, built through numpy, several times faster for a long
    list; floats become float32, as torch.tensor makes them."""
    array = np.array(data)
    return to_device(
        torch.from_numpy(array.astype(np.float32) if array.dtype == np.float64 else array), device
    )


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """To CUDA through pinned memory, non_blocking: queued behind the device's work, where a
    copy from pageable memory would wait for everything queued before it."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
