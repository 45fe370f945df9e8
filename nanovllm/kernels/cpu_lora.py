"""LoRA's adapters on a CPU for a few rows (cpu_lora.cpp): y[i] += (a[s] @ x[i]) @ b[s] for each
row i under slot s >= 0 (b: B transposed), one native call a layer. Built at first use and
loaded with ctypes (kernels/cpu_build.py); `load()` is None, with one warning, where it cannot
be."""

import ctypes
import functools
from pathlib import Path

import torch

from nanovllm.kernels.cpu_build import load_library, native_flags

SOURCE = Path(__file__).with_name("cpu_lora.cpp")
FLAGS = native_flags("-ffp-contract=fast")
MAX_WIDTH = 1024  # cpu_lora.cpp's: the widest stacked rank a row's buffer holds
_INT, _I64, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None (and a warning) if it cannot be."""
    library = load_library(SOURCE, FLAGS, "LoRA's adapters run as PyTorch GEMMs")
    if library is not None:
        library.nanovllm_lora_bgmv.argtypes = (
            _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _INT
        )  # fmt: skip
        library.nanovllm_lora_bgmv.restype = None
    return library


def fits(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> bool:
    """The layouts the C++ indexes: float32 CPU tensors, x and y rows with a contiguous last
    dimension, a and b contiguous, a width it holds."""
    return (
        x.dtype == a.dtype == b.dtype == y.dtype == torch.float32
        and x.is_cpu
        and x.dim() == y.dim() == 2
        and x.stride(1) == 1
        and y.stride(1) == 1
        and a.is_contiguous()
        and b.is_contiguous()
        and a.shape[1] <= MAX_WIDTH
    )


def lora_bgmv(
    library: ctypes.CDLL,
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    slice_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [rows, N] += (a[s] @ x[i]) @ b[s] per row (in place); a [slots, W, K], b [slots, W, N],
    slots [rows] int64 (-1: nothing added). `slice_ends` [S] int64: where each of the layer's S
    slices of the N outputs ends, b holding slice j's weights in rows j*W/S .. (j+1)*W/S only
    (None: one slice). The caller checked fits()."""
    rows, k = x.shape
    slots = slots.contiguous()
    assert slots.dtype == torch.int64 and slots.shape == (rows,), (slots.dtype, slots.shape)
    if slice_ends is None:
        slice_ends = torch.tensor([b.shape[2]])
    assert slice_ends.dtype == torch.int64 and slice_ends[-1] == b.shape[2], slice_ends
    assert a.shape[1] % len(slice_ends) == 0, (a.shape, slice_ends)
    library.nanovllm_lora_bgmv(
        x.data_ptr(),
        x.stride(0),
        a.data_ptr(),
        b.data_ptr(),
        slots.data_ptr(),
        y.data_ptr(),
        y.stride(0),
        rows,
        k,
        a.shape[1],
        b.shape[2],
        slice_ends.data_ptr(),
        len(slice_ends),
        torch.get_num_threads(),
    )
    return y
