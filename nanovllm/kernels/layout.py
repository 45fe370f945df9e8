"""Layout checks of the kernel launchers. A kernel indexes raw memory with the strides
it is given, so a wrong dtype, rank or device would read garbage rather than fail. The
callers are our own backends (the runner binds the cache once), so these are asserts:
a few comparisons per call, that name the argument when one fails."""

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)

# Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when this package is
# imported; the value seen here is the one the kernels were built with.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _INTERPRETED


def assert_rows(name: str, t: torch.Tensor, ndim: int, like: torch.Tensor | None = None) -> None:
    """A float tensor of rank `ndim` with a contiguous last dim, on a device the kernels
    run on (and with `like`'s dtype and device)."""
    assert (
        t.dim() == ndim and t.dtype in FLOAT_DTYPES and (t.shape[-1] == 1 or t.stride(-1) == 1)
    ), (
        f"{name} must be a {ndim}-D float tensor with a contiguous last dim, got {t.dtype} "
        f"of shape {tuple(t.shape)}, strides {t.stride()}"
    )
    assert t.device.type == "cuda" or (t.device.type == "cpu" and _INTERPRETED), (
        f"{name} is on {t.device}: the kernels need CUDA (or the CPU with TRITON_INTERPRET=1)"
    )
    assert like is None or (t.dtype == like.dtype and t.device == like.device), (
        f"{name} is {t.dtype} on {t.device}, not {like.dtype} on {like.device}"
    )


def assert_index(name: str, t: torch.Tensor, ndim: int, length: int, device: torch.device) -> None:
    """A contiguous int32/int64 tensor of rank `ndim` with `length` rows, on `device`."""
    assert (
        t.dim() == ndim
        and t.dtype in INDEX_DTYPES
        and t.is_contiguous()
        and t.shape[0] == length
        and t.device == device
    ), (
        f"{name} must be a contiguous {ndim}-D int32/int64 tensor of {length} rows on {device}, "
        f"got {t.dtype} of shape {tuple(t.shape)} on {t.device}"
    )


def assert_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, like: torch.Tensor) -> int:
    """Both caches [num_blocks, block_size, num_kv_heads, head_dim], one layout (the
    kernels index both with k_cache's strides), `like`'s dtype and head_dim and a number
    of KV heads dividing its heads; returns num_kv_heads."""
    assert_rows("k_cache", k_cache, 4, like)
    assert (
        v_cache.shape == k_cache.shape
        and v_cache.stride() == k_cache.stride()
        and v_cache.dtype == k_cache.dtype
    ), "v_cache must have the layout of k_cache"
    return assert_heads(like, k_cache.shape[2], k_cache.shape[3], "k_cache")


def assert_heads(q: torch.Tensor, num_kv_heads: int, head_dim: int, kv_name: str) -> int:
    assert head_dim == q.shape[-1] and num_kv_heads > 0 and q.shape[-2] % num_kv_heads == 0, (
        f"{kv_name}'s (num_kv_heads, head_dim) ({num_kv_heads}, {head_dim}) do not fit q's "
        f"(num_heads, head_dim) {tuple(q.shape[-2:])}"
    )
    return num_kv_heads
