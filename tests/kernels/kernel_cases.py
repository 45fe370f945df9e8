"""Shared by the kernel tests: where the kernels run, random paged-cache cases, the
error measure and attention written out in float64. The torch backend
(nanovllm/kernels/torch_attention.py), itself tested against attention written out by
tests/test_torch_attention.py, is the Triton kernels' reference.

The tests here run on CUDA when it is present, and on the CPU in Triton's interpreter
when TRITON_INTERPRET=1 was set before anything imported triton: tests/test_kernels.py
runs this folder in such a subprocess, so the rest of the suite keeps its environment.
"""

import os
from dataclasses import dataclass

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
DEVICE = "cpu" if INTERPRET else "cuda" if torch.cuda.is_available() else None
requires_kernels = pytest.mark.skipif(
    DEVICE is None,
    reason="needs CUDA or TRITON_INTERPRET=1 (tests/test_kernels.py runs "
    "this folder under the interpreter)",
)
# ||out - ref|| / ||ref||, ref computed in float32 from the same (rounded) inputs
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
NAN = float("nan")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def randn(
    *shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0
) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen)).to(device=DEVICE, dtype=dtype)


@dataclass
class PagedCache:
    """A paged KV cache holding `seqlens[i]` random tokens for sequence i and NaN in every
    other slot (so a read past a context shows up as NaN in the output)."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks + 1] int32, -1 padded, shuffled ids

    def clean(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 caches with the poison zeroed, for the reference (whose gather reads
        whole blocks and would carry NaN through a masked softmax)."""
        return self.k_cache.float().nan_to_num(0.0), self.v_cache.float().nan_to_num(0.0)

    def context(self, i: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's first `length` keys and values, [length, num_kv_heads, head_dim]."""
        block_size = self.k_cache.shape[1]
        blocks = self.block_tables[i, : -(-length // block_size)].long()
        return (
            self.k_cache[blocks].flatten(0, 1)[:length],
            self.v_cache[blocks].flatten(0, 1)[:length],
        )


def paged_cache(
    seqlens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> PagedCache:
    blocks_per_seq = [-(-n // block_size) for n in seqlens]
    num_blocks = sum(blocks_per_seq) + 2  # two spare blocks, never referenced: all NaN
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, NAN, dtype=dtype, device=DEVICE)
    width = max(blocks_per_seq) + 1  # one more column than needed, as a graph's table has
    block_tables = torch.full((len(seqlens), width), -1, dtype=torch.int32)
    for i, (n, num) in enumerate(zip(seqlens, blocks_per_seq)):
        table, ids = ids[:num], ids[num:]
        block_tables[i, :num] = torch.tensor(table, dtype=torch.int32)
        for pos in range(0, n, block_size):  # fill this sequence's tokens, block by block
            rows = min(block_size, n - pos)
            block = table[pos // block_size]
            k_cache[block, :rows] = randn(rows, num_kv_heads, head_dim, dtype=dtype, gen=gen)
            v_cache[block, :rows] = randn(rows, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    return PagedCache(k_cache, v_cache, block_tables.to(DEVICE))


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] int32 on DEVICE."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out.to(DEVICE)


def attention_written_out(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence's causal attention in float64, by the formula: its last len(q)
    positions' queries over its len(k) keys. q [len_q, heads, head_dim]; k, v [len_k,
    kv_heads, head_dim] (GQA: each KV head serves heads // kv_heads query heads)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    offset = k.shape[0] - q.shape[0]  # query j sits at position offset + j
    visible = (
        torch.arange(k.shape[0], device=q.device)[None, :]
        <= torch.arange(offset, k.shape[0], device=q.device)[:, None]
    )
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)
