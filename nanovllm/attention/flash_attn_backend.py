"""The `flash_attn` attention backend: nano-vLLM's calls, flash_attn_varlen_func for prefill
chunks and flash_attn_with_kvcache for decode; new K/V rows written by our Triton kernel."""

import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.triton_backend import import_error  # it writes the cache


def why_not(device: torch.device, block_size: int) -> str | None:
    """flash-attn runs on CUDA, installed, over blocks of 256 tokens; Triton writes the cache."""
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, not {device.type}; use 'torch'"
    if (error := import_error("flash_attn")) is not None:
        return f"flash-attn is not installed or does not load ({error}); use 'triton'"
    if block_size % 256:
        return (
            f"flash-attn's paged KV cache needs kvcache_block_size % 256 == 0, got "
            f"{block_size}; use kvcache_block_size=256 or attention_backend='triton'"
        )
    if (error := import_error("triton")) is not None:
        return f"triton is not installed or does not load ({error})"
    return None


class FlashAttnBackend:
    """flash-attn's calls, nano-vLLM's; new K/V rows written by our Triton kernel."""

    name = "flash_attn"
    capturable = True

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


Backend = FlashAttnBackend
