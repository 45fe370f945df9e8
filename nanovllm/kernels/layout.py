"""Layout checks shared by the kernel launchers. A kernel indexes raw memory with the
strides it is given, so a wrong dtype, rank or device would read garbage rather than
fail: each check raises a ValueError that names the argument and what to change."""
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


def check_device(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda" or (tensor.device.type == "cpu" and _INTERPRETED):
        return
    raise ValueError(f"{name} is on {tensor.device}; the Triton kernels need CUDA tensors "
                     f"(or CPU tensors with TRITON_INTERPRET=1 set before nanovllm.kernels "
                     f"is imported)")


def check_rows(name: str, tensor: torch.Tensor, dims: str) -> None:
    """A float tensor of shape `dims` (e.g. "[num_tokens, num_heads, head_dim]") whose last
    dimension is contiguous; other strides are passed to the kernel as they are."""
    ndim = dims.count(",") + 1
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {dims}, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {tensor.dtype}")
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides "
                         f"{tensor.stride()}; pass {name}.contiguous()")
    check_device(name, tensor)


def check_index(name: str, tensor: torch.Tensor, ndim: int, device: torch.device) -> None:
    """An int32/int64 index tensor of rank `ndim`, contiguous, on `device`."""
    if tensor.dim() != ndim or tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be a {ndim}-D int32 or int64 tensor, got "
                         f"{tensor.dtype} of shape {tuple(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous; pass {name}.contiguous()")
    check_on(name, tensor, device)


def check_on(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the other tensors are on {device}")


def check_like(name: str, tensor: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Same dtype and device as `ref`."""
    if tensor.dtype != ref.dtype:
        raise ValueError(f"{name} is {tensor.dtype} but {ref_name} is {ref.dtype}; they must match")
    check_on(name, tensor, ref.device)


def check_size(what: str, got: object, expected: object) -> None:
    if got != expected:
        raise ValueError(f"{what} must be {expected}, got {got}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both caches [num_blocks, block_size, num_kv_heads, head_dim] with one layout (the
    kernels index both with k_cache's strides)."""
    check_rows("k_cache", k_cache, "[num_blocks, block_size, num_kv_heads, head_dim]")
    check_like("v_cache", v_cache, "k_cache", k_cache)
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache (shape {tuple(v_cache.shape)}, strides {v_cache.stride()}) "
                         f"must have the layout of k_cache (shape {tuple(k_cache.shape)}, "
                         f"strides {k_cache.stride()})")


def check_paged_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, num_seqs: int) -> int:
    """Caches and block tables for attention over `num_seqs` sequences; num_kv_heads."""
    check_cache(k_cache, v_cache)
    check_like("k_cache", k_cache, "q", q)
    check_size("k_cache's head_dim (dim 3)", k_cache.shape[3], q.shape[2])
    check_index("block_tables", block_tables, 2, q.device)
    check_size("block_tables' rows (one per sequence)", block_tables.shape[0], num_seqs)
    return check_group(q, k_cache.shape[2], "k_cache")


def check_chunk_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """k, v [num_tokens, num_kv_heads, head_dim] beside q; returns num_kv_heads."""
    for name, tensor in (("k", k), ("v", v)):
        check_rows(name, tensor, "[num_tokens, num_kv_heads, head_dim]")
        check_like(name, tensor, "q", q)
        check_size(f"{name}'s num_tokens and head_dim", (tensor.shape[0], tensor.shape[2]),
                   (q.shape[0], q.shape[2]))
    check_size("v's num_kv_heads (k's)", v.shape[1], k.shape[1])
    return check_group(q, k.shape[1], "k")


def check_group(q: torch.Tensor, num_kv_heads: int, kv_name: str) -> int:
    if num_kv_heads == 0 or q.shape[1] % num_kv_heads:
        raise ValueError(f"q's num_heads ({q.shape[1]}) must be a multiple of {kv_name}'s "
                         f"num_kv_heads ({num_kv_heads})")
    return num_kv_heads


def check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def output_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` checked to match q, or a new tensor like q."""
    if out is None:
        return torch.empty_like(q)
    check_rows("out", out, "[num_tokens, num_heads, head_dim]")
    check_like("out", out, "q", q)
    check_size("out's shape (q's)", out.shape, q.shape)
    return out
