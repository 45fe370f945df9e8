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
