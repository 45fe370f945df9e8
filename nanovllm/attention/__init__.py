"""Attention over the paged KV cache behind one backend interface: torch, triton, flash_attn."""

from nanovllm.attention.backend import AttentionBackend, select_backend
from nanovllm.attention.metadata import (
    AttentionMetadata,
    ForwardContext,
    attention_context,
    get_context,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "attention_context",
    "get_context",
    "select_backend",
]
