"""The attention backend interface, and which backend runs where. Each backend is an adapter
from the step's metadata to a kernel module, in a file of its own, imported when chosen:

    torch       torch_backend.py        plain PyTorch on any device; a CPU decodes in C++
    triton      triton_backend.py       our Triton kernels (CUDA, or Triton's interpreter)
    flash_attn  flash_attn_backend.py   flash-attn's kernels, when it is installed
"""

import importlib
from typing import Protocol

import torch

from nanovllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """What every backend implements. Shapes:
    q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; outputs are
    [num_tokens, num_heads, head_dim] (decode: one token per sequence)."""

    name: str
    capturable: bool  # decode never syncs with the host, so a CUDA graph can capture it

    def store_kvcache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def select_backend(
    name: str, candidates: tuple[str, ...], device: torch.device, block_size: int
) -> AttentionBackend:
    """ "auto": the first of the platform's `candidates` that can run here (CUDA's: flash_attn,
    triton, torch), else torch. A named backend that cannot run is a ValueError saying why
    (each backend's module says, `why_not`)."""
    if name == "auto":
        name = next((n for n in candidates if why_not(n, device, block_size) is None), "torch")
    reason = why_not(name, device, block_size)
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} cannot run here: {reason}")
    return _module(name).Backend()


def why_not(name: str, device: torch.device, block_size: int) -> str | None:
    """Why backend `name` cannot run here; None if it can."""
    return _module(name).why_not(device, block_size)


def _module(name: str):
    return importlib.import_module(f"nanovllm.attention.{name}_backend")
