"""The `triton` attention backend: our kernels (nanovllm/kernels/), on CUDA or in Triton's
interpreter (TRITON_INTERPRET=1 set before nanovllm is imported)."""

import importlib

import torch

from nanovllm.attention.metadata import AttentionMetadata


def import_error(module: str) -> str | None:
    """Why `module` does not import (not installed, or it fails); None if it does."""
    try:
        importlib.import_module(module)
    except ImportError as error:
        return str(error)
    return None


def why_not(device: torch.device, block_size: int) -> str | None:
    """Triton must import; its kernels need CUDA, or a CPU in Triton's interpreter."""
    if (error := import_error("triton")) is not None:
        return f"triton is not installed or does not load ({error})"
    if device.type != "cuda":
        from nanovllm.kernels import interpreted

        if device.type != "cpu" or not interpreted():
            return (
                f"the Triton kernels need a CUDA device, not {device.type}; use 'torch' (on a "
                f"CPU they run only in Triton's interpreter: TRITON_INTERPRET=1 set before "
                f"nanovllm is imported, slow, for tests)"
            )
    return None


class TritonBackend:
    """Our kernels, on CUDA or in Triton's interpreter (TRITON_INTERPRET=1)."""

    name = "triton"
    capturable = True  # the decode launcher never syncs with the host

    def __init__(self) -> None:
        from nanovllm import kernels  # imports triton

        self.store_kvcache = kernels.store_kvcache  # the interface's signature
        self._prefill = kernels.paged_prefill_attention
        self._decode = kernels.paged_decode_attention

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return self._prefill(
            q,
            k,
            v,
            k_cache,
            v_cache,
            ctx.cu_seqlens_q,
            ctx.cu_seqlens_k,
            ctx.max_seqlen_q,
            ctx.block_tables,
            scale,
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return self._decode(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale)


Backend = TritonBackend
