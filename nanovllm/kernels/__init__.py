"""Triton kernels of the data plane, each a `@triton.jit` function plus a launcher that
checks the layouts it is given (a ValueError names the argument and what to change).

    store_kvcache            write new tokens' K/V rows into their cache slots (-1 = skip)
    paged_decode_attention   one query per sequence over its block table (GQA, split-K)
    paged_prefill_attention  causal varlen attention, keys from the chunk or the paged cache
    fused_moe                a mixture of experts' two projections as grouped GEMMs over
                             the tokens sorted by expert

Importing this package imports triton. The kernels run on CUDA tensors, or on CPU
tensors in Triton's interpreter when TRITON_INTERPRET=1 was set before this import.
"""
from nanovllm.kernels.fused_moe import fused_moe
from nanovllm.kernels.layout import interpreted
from nanovllm.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from nanovllm.kernels.store_kvcache import store_kvcache

__all__ = ["fused_moe", "interpreted", "paged_decode_attention", "paged_prefill_attention", "store_kvcache"]
