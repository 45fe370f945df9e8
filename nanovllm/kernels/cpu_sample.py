"""The CPU's draw from softmax(logits) (cpu_sample.cpp) and its launcher: per row, the first
token whose float64 CDF reaches u * total, without writing a [rows, vocab] probability or
CDF (row max, exp in 64-token chunks with float64 chunk sums, the chosen chunk rescanned); and a
greedy row's token, torch.argmax's, vectorized.
Built at first use and loaded with ctypes (kernels/cpu_build.py); `load()` is None, with one
warning, where it cannot be built."""

import ctypes
import functools
from pathlib import Path

import torch

from nanovllm.kernels.cpu_build import load_library, native_flags

SOURCE = Path(__file__).with_name("cpu_sample.cpp")
FLAGS = native_flags("-fno-trapping-math")
_INT, _PTR = ctypes.c_int, ctypes.c_void_p


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None (and a warning) if it cannot be."""
    library = load_library(
        SOURCE, FLAGS, "the CPU samples through torch's softmax and a float64 cumsum"
    )
    if library is not None:
        library.nanovllm_sample.argtypes = (_PTR, _INT, _INT, _PTR, _PTR, _INT)
        library.nanovllm_sample.restype = None
        library.nanovllm_argmax.argtypes = (_PTR, _INT, _INT, _PTR, _INT)
        library.nanovllm_argmax.restype = None
    return library


def sample(library: ctypes.CDLL, logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """logits [B, vocab] float32, u [B, 1] float64 in (0, 1] -> [B] int64 token ids."""
    assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_cpu, logits.dtype
    assert u.dtype == torch.float64 and u.shape == (len(logits), 1), (u.dtype, u.shape)
    logits, u = logits.contiguous(), u.contiguous()
    out = torch.empty(len(logits), dtype=torch.int64)
    library.nanovllm_sample(
        logits.data_ptr(), *logits.shape, u.data_ptr(), out.data_ptr(), torch.get_num_threads()
    )
    return out


def argmax(library: ctypes.CDLL, logits: torch.Tensor) -> torch.Tensor:
    """logits [B, vocab] float32, contiguous on the CPU (unchecked: the caller's) -> [B] int64:
    torch.argmax(logits, dim=-1)."""
    out = torch.empty(len(logits), dtype=torch.int64)
    library.nanovllm_argmax(
        logits.data_ptr(), *logits.shape, out.data_ptr(), torch.get_num_threads()
    )
    return out
