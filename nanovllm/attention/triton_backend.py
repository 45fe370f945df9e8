"""The `triton` backend: our kernels, on CUDA or in Triton's interpreter (TRITON_INTERPRET=1)."""
import torch

from nanovllm.kernels import paged_decode_attention, paged_prefill_attention, store_kvcache
from nanovllm.attention.metadata import AttentionMetadata


class TritonBackend:
    """Attention through the Triton kernels (see AttentionBackend for the shapes)."""

    name = "triton"

    store_kvcache = staticmethod(store_kvcache)  # the Triton kernel, same signature

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, ctx: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_prefill_attention(q, k, v, k_cache, v_cache, ctx.cu_seqlens_q,
                                       ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.block_tables, scale)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               ctx: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens,
                                      scale)
