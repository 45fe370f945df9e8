"""Decode attention by gathering: each sequence's context rows are copied out of the paged
cache into a dense [n, kv_heads, len, head_dim] block and one SDPA runs over it. The torch
backend's decode where the C++ kernel is not used (another device, no compiler, or as the
reference), planned once per step (decode_groups) and reused by every layer.

On a CPU the sequences go in groups by context length, each padded to its own longest, small
enough to stay in cache (several times faster than one padded batch of 128); elsewhere one
group of static shape, with no host sync."""

from typing import NamedTuple

import torch

from nanovllm.kernels import torch_attention

DECODE_GROUP_SIZE = 8  # sequences a CPU decodes in one gathered SDPA


class DecodeGroup(NamedTuple):
    """Rows of the batch that decode in one attention call."""

    rows: torch.Tensor | None  # [n] their batch rows, longest context first; None: all, as is
    slots: torch.Tensor  # [n, max_len] cache slot of each context token (padding: 0)
    mask: torch.Tensor  # [n, 1, 1, max_len] True for real tokens


def gathered_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: list[DecodeGroup],
    scale: float,
) -> torch.Tensor:
    """q [num_seqs, heads, dim] -> [num_seqs, heads, dim], one query per sequence."""
    if groups[0].rows is None:
        return torch_attention.decode_attention(q, k_cache, v_cache, *groups[0][1:], scale)
    out = torch.empty_like(q)
    for g in groups:
        decoded = torch_attention.decode_attention(
            q[g.rows], k_cache, v_cache, g.slots, g.mask, scale
        )
        out.index_copy_(0, g.rows, decoded)
    return out


def decode_groups(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> list[DecodeGroup]:
    """A decode step's plan, the same for every layer."""
    lens, n = context_lens, DECODE_GROUP_SIZE
    if not lens.is_cpu:
        width = block_tables.shape[1] * block_size
        return [DecodeGroup(None, *slot_matrix(block_tables, lens, width, block_size))]
    lens, order = lens.sort(descending=True)
    host_lens = lens.tolist()
    slots, valid = slot_matrix(block_tables.index_select(0, order), lens, host_lens[0], block_size)
    return [
        DecodeGroup(
            order[i : i + n],
            slots[i : i + n, : host_lens[i]].contiguous(),
            valid[i : i + n, ..., : host_lens[i]],
        )
        for i in range(0, len(host_lens), n)
    ]


def slot_matrix(
    block_tables: torch.Tensor, context_lens: torch.Tensor, max_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of each sequence's first max_len positions [n, max_len] (0 past its
    context), and which are real [n, 1, 1, max_len]."""
    pos = torch.arange(max_len, device=context_lens.device)
    blocks = block_tables.index_select(1, pos // block_size).long()
    valid = pos < context_lens[:, None]
    slots = (blocks * block_size + pos % block_size).masked_fill_(~valid, 0)
    return slots, valid[:, None, None, :]
