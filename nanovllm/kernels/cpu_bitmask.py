"""A token bitmask applied to logits on the CPU (cpu_bitmask.cpp) and its launcher: -inf for
every token a row's bitmask forbids, each 32-token word looked at once (all allowed: skipped;
none: filled). Structured outputs' mask (xgrammar's layout: int32 words, bit t % 32 of word
t // 32). Built at first use and loaded with ctypes (kernels/cpu_build.py); `load()` is None,
with one warning, where it cannot be built."""

import ctypes
import functools
from pathlib import Path

import torch

from nanovllm.kernels.cpu_build import load_library, native_flags

SOURCE = Path(__file__).with_name("cpu_bitmask.cpp")
FLAGS = native_flags()
_INT, _INT64, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None (and a warning) if it cannot be."""
    library = load_library(SOURCE, FLAGS, "xgrammar's own kernel applies the bitmask")
    if library is not None:
        library.nanovllm_apply_bitmask.argtypes = (_PTR, _INT, _INT64, _PTR, _INT, _PTR, _INT, _INT)
        library.nanovllm_apply_bitmask.restype = None
    return library


def apply_bitmask(
    library: ctypes.CDLL, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """logits [B, vocab] float32 (rows contiguous), bitmask [>= B, ceil(vocab / 32)] int32,
    rows [R] int64: -inf in place where row rows[i]'s bits are 0."""
    assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_cpu, logits.dtype
    assert logits.stride(1) == 1, logits.stride()
    words = (logits.shape[1] + 31) // 32
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous(), bitmask.dtype
    assert bitmask.shape[1] == words and len(bitmask) >= len(logits), bitmask.shape
    assert rows.dtype == torch.int64 and rows.is_contiguous(), rows.dtype
    assert len(rows) == 0 or 0 <= int(rows.min()) <= int(rows.max()) < len(logits), rows
    library.nanovllm_apply_bitmask(
        logits.data_ptr(),
        logits.shape[1],
        logits.stride(0),
        bitmask.data_ptr(),
        words,
        rows.data_ptr(),
        len(rows),
        torch.get_num_threads(),
    )
