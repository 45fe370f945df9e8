"""Paged decode attention on a CPU, straight from the paged cache (cpu_decode.cpp), and
its launcher. The C++ is built at first use and loaded with ctypes (kernels/cpu_build.py).

`load()` is None, with one warning saying why, when no compiler is found or the build
fails; the torch backend then gathers the rows in use as before.
"""

import ctypes
import functools
from pathlib import Path

import torch

from nanovllm.kernels.cpu_build import load_library, native_flags

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
# -fno-trapping-math: the softmax loop's selects may be if-converted, so it vectorizes (not
# -ffast-math: GCC 12 would link crtfastmath, flushing denormals in the whole process).
FLAGS = native_flags("-fno-trapping-math")
DTYPES = (torch.float32, torch.bfloat16)  # the cache dtypes it reads
_INT, _PTR = ctypes.c_int, ctypes.c_void_p
_ARGTYPES = (
    _PTR,
    _PTR,
    _PTR,
    _PTR,
    _PTR,
    ctypes.c_int64,
    _PTR,
    _INT,
    _INT,
    _INT,
    _INT,
    _INT,
    ctypes.c_float,
    _INT,
    _INT,
)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use; None (and a warning) if it cannot be."""
    library = load_library(SOURCE, FLAGS, "decode gathers K/V rows instead")
    if library is not None:
        library.nanovllm_paged_decode.argtypes = _ARGTYPES
        library.nanovllm_paged_decode.restype = None
    return library


def paged_decode(
    library: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [n, heads, dim] -> [n, heads, dim]: one query per sequence over its
    context_lens[i] cached tokens. Caches [num_blocks, block_size, kv_heads, dim]."""
    _check(q, k_cache, v_cache, block_tables, context_lens)
    n, num_heads, head_dim = q.shape
    query = q.float().contiguous()
    out = torch.empty_like(query)
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    library.nanovllm_paged_decode(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        n,
        num_heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        scale,
        int(k_cache.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _check(q, k_cache, v_cache, block_tables, context_lens) -> None:
    """Layouts the C++ indexes by hand: a mismatch would read the wrong memory."""
    assert q.device.type == k_cache.device.type == "cpu", "CPU tensors only"
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in DTYPES, k_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert q.dim() == 3 and q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0
    assert block_tables.dtype == context_lens.dtype == torch.int32
    assert block_tables.shape[0] == context_lens.shape[0] == q.shape[0]
