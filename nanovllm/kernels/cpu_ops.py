"""RMSNorm (alone or after the residual add) and rotary embedding on a CPU, one native call
each (cpu_ops.cpp, built as kernels/cpu_build.py says) instead of PyTorch's 5-10 small ops.

Each function is the CPU twin of an eager op of layers/ (the CPU platform's choice,
platforms/cpu/ops.py): it is given that op's eager function first and returns exactly what it
would, bit for bit in float32 and bfloat16; for what the C++ does not cover (another dtype, a
layout it does not index, no compiler) it calls the eager function. What is left of a call at
decode sizes is mostly its Python (checks, the output's allocation, ctypes). From PyTorch's
grain size (32768 elements) on, the rows are spread over torch's threads. The figures per shape
are in docs/cpu.md#c-norms-and-rotary (benchmarks/cpu_ops.py).
"""

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from nanovllm.kernels.cpu_build import load_library, native_flags

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
# -ffp-contract=off: a*b + c rounded twice, as PyTorch's separate ops do (GCC would fuse an
# FMA); -fno-math-errno: sqrt is one instruction (no errno for a negative).
FLAGS = native_flags("-ffp-contract=off", "-fno-math-errno")
DTYPES = (torch.float32, torch.bfloat16)
# Lanes of the float vector of PyTorch's CPU sum, which set the order of its sums (cpu_ops.cpp):
# 8 on x86, under AVX-512 too (torch registers no AVX-512 sum kernel: those CPUs run the AVX2
# one); under another (ARM's NEON) a mean may differ in its last bit.
LANES = 8
_INT, _I64, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None (and a warning) if it cannot be."""
    library = load_library(SOURCE, FLAGS, "RMSNorm and rotary run as PyTorch ops")
    if library is not None:
        library.nanovllm_rms_norm.argtypes = (
            _PTR,
            _I64,
            _PTR,
            _PTR,
            _PTR,
            _PTR,
            _I64,
            _INT,
            _INT,
            ctypes.c_float,
            _INT,
            _INT,
            _INT,
        )
        library.nanovllm_rms_norm.restype = None
        library.nanovllm_rotary.argtypes = (
            _PTR,
            _PTR,
            _I64,
            _PTR,
            _I64,
            _PTR,
            _I64,
            _PTR,
            _I64,
            _INT,
            _INT,
            _INT,
            _INT,
            _INT,
        )
        library.nanovllm_rotary.restype = _I64
    return library


def rms_norm(eager: Callable, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [tokens, hidden] or [tokens, heads, head_dim] normalized over its last dim."""
    if (library := load()) is None or not _rows_fit(x, weight):
        return eager(x, weight, eps)
    out = torch.empty_like(x)  # contiguous: x is, or is not dense (a view of qkv's rows)
    _norm(library, x, None, weight, out, None, eps)
    return out


def add_rms_norm(
    eager: Callable, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); x, residual [tokens, hidden], contiguous."""
    if (
        (library := load()) is None
        or not _rows_fit(x, weight)
        or not x.is_contiguous()
        or not residual.is_contiguous()
        or residual.shape != x.shape
        or residual.dtype != x.dtype
    ):
        return eager(x, residual, weight, eps)
    out, total = torch.empty_like(x), torch.empty_like(x)
    _norm(library, x, residual, weight, out, total, eps)
    return out, total


def apply_rotary_emb(
    eager: Callable,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim] rotated by positions
    [tokens]; cos_sin_cache [max_position, 2, head_dim] float32. Returns views of one
    [tokens, heads + kv_heads, head_dim] tensor, as the eager op."""
    (tokens, num_heads, head_dim), num_kv_heads = q.shape, k.shape[1]
    if (
        (library := load()) is None
        or not _heads_fit(q)
        or not _heads_fit(k)
        or k.dtype != q.dtype
        or k.shape[0] != tokens
        or k.shape[2] != head_dim
        or head_dim % 2
        or positions.dtype != torch.int64
        or positions.shape != (tokens,)
        or not positions.is_contiguous()
        or cos_sin_cache.dtype != torch.float32
        or cos_sin_cache.shape[1:] != (2, head_dim)
        or not cos_sin_cache.is_contiguous()
    ):
        return eager(positions, q, k, cos_sin_cache)
    out = q.new_empty(tokens, num_heads + num_kv_heads, head_dim)
    bad = library.nanovllm_rotary(
        positions.data_ptr(),
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        cos_sin_cache.data_ptr(),
        cos_sin_cache.shape[0],
        out.data_ptr(),
        tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        q.dtype == torch.bfloat16,
        torch.get_num_threads(),
    )
    if bad >= 0:
        raise IndexError(
            f"position {int(positions[bad])} is outside the rotary cache "
            f"(max_position {cos_sin_cache.shape[0]})"
        )
    return out.split_with_sizes((num_heads, num_kv_heads), dim=1)


def _heads_fit(x: torch.Tensor) -> bool:
    """A CPU tensor the C++ indexes: [tokens, hidden] or [tokens, heads, dim] whose token rows
    are a stride apart, each contiguous (q and k are views of the qkv projection's rows)."""
    strides = x.stride()
    return (
        x.dtype in DTYPES
        and x.is_cpu
        and strides[-1] == 1
        and (len(strides) == 2 or len(strides) == 3 and strides[1] == x.shape[2])
    )


def _rows_fit(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Also not a lone row of PyTorch's grain size or more on several threads: PyTorch splits
    its sum over the threads (another order)."""
    return (
        _heads_fit(x)
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and weight.shape[0] == x.shape[-1]
        and weight.dim() == 1
        and (x.shape[-1] < 32768 or x.numel() > x.shape[-1] or torch.get_num_threads() == 1)
    )


def _norm(
    library: ctypes.CDLL,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    total: torch.Tensor | None,
    eps: float,
) -> None:
    shape = x.shape
    library.nanovllm_rms_norm(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        None if total is None else total.data_ptr(),
        shape[0],
        shape[1] if len(shape) == 3 else 1,
        shape[-1],
        eps,
        LANES,
        x.dtype == torch.bfloat16,
        torch.get_num_threads(),
    )
