"""Attention over the paged KV cache, behind one backend interface: `torch` (the
reference; runs anywhere, the CPU path), `triton` (our kernels; the GPU default where
flash-attn is missing) and `flash_attn` (CUDA, when installed)."""
from nanovllm.attention.backend import AttentionBackend, select_backend
from nanovllm.attention.metadata import (AttentionMetadata, ForwardContext, attention_context,
                                         get_context)

__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext", "attention_context",
           "get_context", "select_backend"]
