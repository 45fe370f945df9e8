"""The attention backend interface, which backend runs where, and the backends: each an adapter
from the step's metadata to a kernel module (torch: kernels/torch_attention.py and, for a CPU's
decode, kernels/cpu_decode.py; triton: our Triton kernels; flash_attn: flash-attn's, imported
when built)."""

import importlib
from typing import Protocol

import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.kernels import cpu_decode, torch_attention


class AttentionBackend(Protocol):
    """What every backend implements. Shapes:
    q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; outputs are
    [num_tokens, num_heads, head_dim] (decode: one token per sequence)."""

    name: str

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


def select_backend(name: str, device: torch.device, block_size: int) -> AttentionBackend:
    """ "auto": flash_attn where it can run, else triton on CUDA, else torch. A named backend
    that cannot run is a ValueError saying why; triton and flash-attn are imported if chosen."""
    if name == "auto":
        candidates = ("flash_attn", "triton") if device.type == "cuda" else ()
        name = next((n for n in candidates if _why_not(n, device, block_size) is None), "torch")
    reason = None if name == "torch" else _why_not(name, device, block_size)
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} cannot run here: {reason}")
    return {"torch": TorchBackend, "triton": TritonBackend, "flash_attn": FlashAttnBackend}[name]()


class TorchBackend:
    """Plain PyTorch on any device; a CPU decodes in the C++ kernel where it builds."""

    name = "torch"
    store_kvcache = staticmethod(torch_attention.store_kvcache)

    def __init__(self, native_cpu_decode: bool = True) -> None:
        """native_cpu_decode=False: the gathering decode on the CPU too (the reference)."""
        self.native_cpu_decode = native_cpu_decode
        self._decode_step: tuple[AttentionMetadata, list] | None = None  # (its ctx, its groups)

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
        return torch_attention.prefill_attention(
            q, k, v, k_cache, v_cache, ctx.seqlens_q, ctx.seqlens_k, ctx.block_tables, scale
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if self.native_cpu_decode and q.device.type == "cpu" and k_cache.dtype in cpu_decode.DTYPES:
            if (library := cpu_decode.load()) is not None:
                return cpu_decode.paged_decode(
                    library, q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale
                )
        if self._decode_step is None or self._decode_step[0] is not ctx:  # a step's first layer
            self._decode_step = (
                ctx,
                torch_attention.decode_groups(ctx.block_tables, ctx.context_lens, k_cache.shape[1]),
            )
        return torch_attention.decode_attention(q, k_cache, v_cache, self._decode_step[1], scale)


class TritonBackend:
    """Our kernels, on CUDA or in Triton's interpreter (TRITON_INTERPRET=1)."""

    name = "triton"

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


class FlashAttnBackend:
    """flash-attn's calls, nano-vLLM's; new K/V rows written by our Triton kernel."""

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from nanovllm.kernels import store_kvcache

        self.store_kvcache = store_kvcache
        self._varlen, self._with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

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
        if ctx.block_tables is not None:  # a cached prefix: keys come from the paged cache
            k, v = k_cache, v_cache
        # flash-attn aligns the causal mask bottom-right when seqlen_q < seqlen_k
        return self._varlen(
            q,
            k,
            v,
            cu_seqlens_q=ctx.cu_seqlens_q,
            cu_seqlens_k=ctx.cu_seqlens_k,
            max_seqlen_q=ctx.max_seqlen_q,
            max_seqlen_k=ctx.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=ctx.block_tables,
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # [num_seqs, 1, num_heads, head_dim]: one query token per sequence
        out = self._with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=ctx.context_lens,
            block_table=ctx.block_tables,
            softmax_scale=scale,
            causal=True,
        )
        return out.squeeze(1)


def _why_not(name: str, device: torch.device, block_size: int) -> str | None:
    """Why "triton" or "flash_attn" cannot run here; None if it can."""
    if name == "flash_attn":
        if device.type != "cuda":
            return f"flash-attn needs a CUDA device, not {device.type}; use 'torch'"
        if (error := _import_error("flash_attn")) is not None:
            return f"flash-attn is not installed or does not load ({error}); use 'triton'"
        if block_size % 256:
            return (
                f"flash-attn's paged KV cache needs kvcache_block_size % 256 == 0, got "
                f"{block_size}; use kvcache_block_size=256 or attention_backend='triton'"
            )
    if (error := _import_error("triton")) is not None:  # flash_attn writes the cache with it too
        return f"triton is not installed or does not load ({error})"
    if name == "triton" and device.type != "cuda":
        from nanovllm.kernels import interpreted

        if device.type != "cpu" or not interpreted():
            return (
                f"the Triton kernels need a CUDA device, not {device.type}; use 'torch' (on a "
                f"CPU they run only in Triton's interpreter: TRITON_INTERPRET=1 set before "
                f"nanovllm is imported, slow, for tests)"
            )
    return None


def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except ImportError as error:
        return str(error)
    return None
