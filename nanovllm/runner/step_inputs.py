"""A scheduled batch (decoding sequences first) -> the model's inputs and the step's
ForwardContext, built on the host (what rank 0 sends tensor-parallel workers); the platform puts
them on the device. A sequence computes num_scheduled_tokens tokens from num_cached_tokens on; a
new token's K/V goes to its slot (block_size 4):

    block_table = [7, 2]          position p -> slot block_table[p // 4] * 4 + p % 4
    positions     0  1  2  3 | 4  5
    slots        28 29 30 31 | 8  9

A decoding sequence is one decode row, or 1 + d verifying d drafts (speculative decoding): each
row a query at its position over the cache up to itself, all of the rows' K/V stored first, so
each sees the drafts before it (causal attention over the chunk, on the decode path).
"""

from typing import NamedTuple

import numpy as np
import torch

from nanovllm.attention.metadata import AttentionMetadata, ForwardContext
from nanovllm.core.sequence import Sequence, logits_rows


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    context: ForwardContext


def prepare_inputs(seqs: list[Sequence], block_size: int) -> StepInputs:
    """The batch's tokens, positions and attention metadata, built on the host."""
    num_decode = next((i for i, seq in enumerate(seqs) if seq.is_prefill), len(seqs))
    input_ids, positions, lens_q = _token_rows(seqs, num_decode)
    block_tables = _block_tables(seqs)
    slots = _slot_mapping(block_tables, positions, lens_q, block_size)
    num_decode_rows = sum(lens_q[:num_decode])
    ctx = ForwardContext(torch.from_numpy(slots), num_decode_tokens=num_decode_rows)
    if num_decode:  # each decode row attends over its context, itself included
        tables = block_tables[:num_decode]
        if num_decode_rows > num_decode:  # rows verifying drafts: their table each
            tables = np.repeat(tables, lens_q[:num_decode], axis=0)
        context_lens = (positions[:num_decode_rows] + 1).astype(np.int32)
        ctx.decode = AttentionMetadata(
            torch.from_numpy(tables), context_lens=torch.from_numpy(context_lens)
        )
    if num_decode < len(seqs):
        ctx.prefill = _prefill_metadata(seqs[num_decode:], block_tables[num_decode:])
        ctx.logits_indices = _logits_indices(seqs, lens_q, num_decode)
    return StepInputs(torch.from_numpy(input_ids), torch.from_numpy(positions), ctx)


def _token_rows(seqs: list[Sequence], num_decode: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Token ids and positions [num_tokens] int64: each decoding sequence's row (its last token),
    then each prefill chunk's tokens; and each sequence's number of rows (lens_q)."""
    lens_q = [seq.num_scheduled_tokens for seq in seqs]
    decode, chunks = seqs[:num_decode], seqs[num_decode:]
    if sum(lens_q[:num_decode]) > num_decode:  # some verify drafts: rows as a chunk's
        decode, chunks = [], seqs
    input_ids = [seq.last_token for seq in decode]
    positions = [seq.num_tokens - 1 for seq in decode]
    for seq in chunks:
        start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
    return np.array(input_ids, dtype=np.int64), np.array(positions, dtype=np.int64), lens_q


def _slot_mapping(
    block_tables: np.ndarray, positions: np.ndarray, lens_q: list[int], block_size: int
) -> np.ndarray:
    """Each token's cache slot [num_tokens] int64 (the picture at the top)."""
    if len(lens_q) == len(positions):  # one row per sequence: no repeat needed
        rows = np.arange(len(lens_q))
    else:
        rows = np.repeat(np.arange(len(lens_q)), lens_q)
    blocks = block_tables[rows, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size


def _block_tables(seqs: list[Sequence]) -> np.ndarray:
    """[num_seqs, width] int32, padded with -1: the tables' bytes joined, spread by a mask (or,
    every table as long, as they are: a single stream's)."""
    joined = bytearray(b"".join([seq.block_table for seq in seqs]))
    lens = [len(seq.block_table) for seq in seqs]
    if min(lens) == max(lens):
        return np.frombuffer(joined, np.intc).reshape(len(seqs), lens[0])
    lens = np.array(lens)
    padded = np.full((len(seqs), lens.max()), -1, np.int32)
    padded[np.arange(padded.shape[1]) < lens[:, None]] = np.frombuffer(joined, np.intc)
    return padded


def _logits_indices(seqs: list[Sequence], lens_q: list[int], num_decode: int) -> torch.Tensor:
    """The rows the LM head computes: every decode row, then each prompt chunk's last, or its
    last logits_rows()."""
    ends = torch.tensor(lens_q).cumsum(0)
    rows = logits_rows(seqs)
    if rows is None and sum(lens_q[:num_decode]) == num_decode:
        return ends - 1
    rows = rows or [1] * len(seqs)
    rows[:num_decode] = lens_q[:num_decode]
    return torch.cat([torch.arange(end - n, end) for end, n in zip(ends.tolist(), rows)])


def _prefill_metadata(seqs: list[Sequence], block_tables: np.ndarray) -> AttentionMetadata:
    """Each chunk's queries over its keys (cached prefix + chunk); block tables only when
    some chunk has a prefix to read from the cache."""
    seqlens_q = [seq.num_scheduled_tokens for seq in seqs]
    seqlens_k = [seq.num_cached_tokens + n for seq, n in zip(seqs, seqlens_q)]
    cu_seqlens = torch.zeros(2, len(seqs) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor([seqlens_q, seqlens_k]), 1, out=cu_seqlens[:, 1:])
    has_prefix = any(seq.num_cached_tokens for seq in seqs)
    return AttentionMetadata(
        block_tables=torch.from_numpy(block_tables) if has_prefix else None,
        cu_seqlens_q=cu_seqlens[0],
        cu_seqlens_k=cu_seqlens[1],
        max_seqlen_q=max(seqlens_q),
        max_seqlen_k=max(seqlens_k),
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
    )
