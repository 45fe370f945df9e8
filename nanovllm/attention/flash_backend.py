"""The `flash_attn` backend (CUDA; kvcache_block_size % 256 == 0): flash-attn imported when
it is built, never at nanovllm's import; new K/V rows written by our Triton kernel."""
import torch

from nanovllm.kernels import store_kvcache
from nanovllm.attention.metadata import AttentionMetadata


class FlashAttnBackend:
    """Attention through flash-attn (see AttentionBackend for the shapes)."""

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    store_kvcache = staticmethod(store_kvcache)  # the Triton kernel, same signature

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, ctx: AttentionMetadata, scale: float) -> torch.Tensor:
        if ctx.block_tables is not None:  # a cached prefix: keys come from the paged cache
            k, v = k_cache, v_cache
        # flash-attn aligns the causal mask bottom-right when seqlen_q < seqlen_k
        return self._varlen(q, k, v, cu_seqlens_q=ctx.cu_seqlens_q, cu_seqlens_k=ctx.cu_seqlens_k,
                            max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k,
                            softmax_scale=scale, causal=True, block_table=ctx.block_tables)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               ctx: AttentionMetadata, scale: float) -> torch.Tensor:
        # [num_seqs, 1, num_heads, head_dim]: one query token per sequence
        out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx.context_lens,
                                 block_table=ctx.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)
