"""Attention over the paged KV cache: decode (one query per sequence) and varlen prefill.

Both fold key tiles into a running softmax (flash-attention's online softmax, in base 2):

    m = max logit so far, l = sum of exp2(logit - m), acc = sum of exp2(logit - m) * v
    a new tile with logits s:  m' = max(m, max s);  l' = l * exp2(m - m') + sum exp2(s - m')
                               acc' = acc * exp2(m - m') + exp2(s - m') @ v;  out = acc / l

Key position p of sequence i lives at k_cache[block_tables[i, p // block_size],
p % block_size]. Decode may split a sequence's keys over NUM_SPLITS programs
(flash-decoding); a second kernel merges their (m, l, acc) partials the same way.
"""

import math
from functools import cache

import torch
import triton
import triton.language as tl

from nanovllm.kernels.layout import (
    assert_cache,
    assert_heads,
    assert_index,
    assert_rows,
    interpreted,
)

LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 256  # a decode split reads at least this many keys ...
MAX_SPLITS = 16  # ... and a sequence is split at most this many ways


@triton.jit
def _load_kv_tile(
    k_ptr,
    v_ptr,
    block_table_ptr,
    first_row,
    pos,
    valid,
    dims,
    dim_mask,
    kv_head,
    block_size,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    PAGED: tl.constexpr,
):
    """K and V rows of key positions `pos` ([BLOCK_N]) as [BLOCK_N, BLOCK_D] tiles; rows
    where `valid` is false read as 0 (never their memory, which may be poison)."""
    if PAGED:  # k_ptr, v_ptr: the caches; position -> (block in the table, offset in it)
        block = tl.load(block_table_ptr + pos // block_size, mask=valid, other=0).to(tl.int64)
        offset = pos % block_size
    else:  # k_ptr, v_ptr: the chunk's own rows, this sequence's start at first_row
        block = tl.zeros_like(pos).to(tl.int64)
        offset = (first_row + pos).to(tl.int64)
    k_rows = block * stride_kb + offset * stride_kt + kv_head * stride_kh
    v_rows = block * stride_vb + offset * stride_vt + kv_head * stride_vh
    mask = valid[:, None] & dim_mask[None, :]
    k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _online_softmax_step(
    q, k, v, mask, m_i, l_i, acc, qk_scale, DOT_F32: tl.constexpr, PRECISION: tl.constexpr
):
    """Fold one key tile into (m_i, l_i, acc). q [M, D], k and v [N, D], mask [M or 1, N].
    Every row must see a valid key in its first tile, so m_i is finite from then on.
    PRECISION: "ieee" for float32 tiles (TF32 would cost float32 its accuracy).
    DOT_F32: multiply exact fp32 copies of the 16-bit tiles (for Triton's interpreter,
    whose tl.dot multiplies bfloat16 tiles as raw integers)."""
    if DOT_F32:
        q, k = q.to(tl.float32), k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None]).to(v.dtype)  # 16-bit P @ V, as flash-attention does
    l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
    if DOT_F32:
        p, v = p.to(tl.float32), v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,  # [seqs, heads, splits(, dim)] fp32; NUM_SPLITS > 1
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_ct,
    stride_ch,
    qk_scale,
    block_size,
    head_dim,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (seq, kv_head, split): the GROUP query heads of one KV head read each K/V
    tile once, as the rows of one [BLOCK_G, BLOCK_D] query tile."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)  # 0 for a padding row: no key is read
    keys_per_split = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, context_len)

    group, dims = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + group
    dim_mask = dims < head_dim
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=(group < GROUP)[:, None] & dim_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            block_tables_ptr + seq * stride_bt,
            0,
            pos,
            valid,
            dims,
            dim_mask,
            kv_head,
            block_size,
            stride_cb,
            stride_ct,
            stride_ch,
            stride_cb,
            stride_ct,
            stride_ch,
            PAGED=True,
        )
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, DOT_F32, PRECISION
        )

    store_mask = (group < GROUP)[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no keys (padding): 0, not NaN
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        part = (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_m_ptr + part, m_i, mask=group < GROUP)
        tl.store(part_l_ptr + part, l_i, mask=group < GROUP)
        tl.store(part_acc_ptr + part[:, None] * head_dim + dims[None, :], acc, mask=store_mask)


@triton.jit
def _decode_merge_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (seq, head): merge the NUM_SPLITS partial softmaxes of one query head."""
    seq, head = tl.program_id(0), tl.program_id(1)
    splits, dims = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + splits
    has_split = splits < NUM_SPLITS
    m = tl.load(part_m_ptr + part, mask=has_split, other=float("-inf"))
    sums = tl.load(part_l_ptr + part, mask=has_split, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * head_dim + dims[None, :],
        mask=has_split[:, None] & (dims < head_dim)[None, :],
        other=0.0,
    )
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: weights 0
    weight = tl.exp2(m - m_max)  # an empty split (m = -inf) weighs 0
    l_sum = tl.sum(sums * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    block_tables_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    qk_scale,
    block_size,
    head_dim,
    GROUP: tl.constexpr,
    PAGED: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (query tile, head, seq). Causal, aligned bottom-right: query j of a chunk
    sits at position seqlen_k - seqlen_q + j and sees keys 0 ..= that position.

        keys     [ cached prefix ........ | chunk            ]
        query j                             ^ seqlen_k - seqlen_q + j
    """
    tile, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    seqlen_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    seqlen_k = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = seqlen_k - seqlen_q + rows  # [BLOCK_M] positions of the queries
    # keys past this tile's last query are masked for all of it; a tile past the chunk's
    # end (the grid covers the longest chunk) reads nothing and writes nothing
    end = tl.where(tile * BLOCK_M < seqlen_q, tl.minimum(seqlen_k, tl.max(q_pos, 0) + 1), 0)

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    row_mask = (rows < seqlen_q)[:, None] & dim_mask[None, :]
    q_offsets = (
        (q_start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    )
    q = tl.load(q_ptr + q_offsets, mask=row_mask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < end
        k, v = _load_kv_tile(
            k_ptr,
            v_ptr,
            block_tables_ptr + seq * stride_bt,
            k_start,
            pos,
            valid,
            dims,
            dim_mask,
            kv_head,
            block_size,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            PAGED=PAGED,
        )
        causal = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, causal, m_i, l_i, acc, qk_scale, DOT_F32, PRECISION
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offsets = (
        (q_start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    )
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim] -> out of the same shape. block_tables
    [num_seqs, max_blocks] (-1 padded), context_lens [num_seqs]; a row with context_len 0
    (padding) reads nothing and gets zeros. The grid and `num_splits` (None: chosen from
    the shapes) depend on shapes only, never on values: no host sync, so a CUDA graph
    can capture it. `out`: where to write (default: a new tensor)."""
    assert_rows("q", q, 3)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = assert_cache(k_cache, v_cache, like=q)
    assert_index("block_tables", block_tables, 2, num_seqs, q.device)
    assert_index("context_lens", context_lens, 1, num_seqs, q.device)
    block_size = k_cache.shape[1]
    if num_splits is None:
        num_splits = decode_num_splits(
            num_seqs, num_kv_heads, block_tables.shape[1] * block_size, q.device
        )
    assert isinstance(num_splits, int) and num_splits >= 1, f"num_splits={num_splits!r}"
    out = _output_like(q, out)
    if num_seqs == 0:
        return out
    group, block_d = num_heads // num_kv_heads, triton.next_power_of_2(head_dim)
    part_m = part_l = part_acc = out  # placeholders: the kernel only touches them when split
    if num_splits > 1:
        part_m = q.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = q.new_empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_m,
        part_l,
        part_acc,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scale * LOG2E,
        block_size,
        head_dim,
        GROUP=group,
        NUM_SPLITS=num_splits,
        **_dot_options(q.dtype),
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        BLOCK_N=_keys_per_tile(q.dtype, block_d),
        BLOCK_D=block_d,
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_m,
            part_l,
            part_acc,
            out,
            out.stride(0),
            out.stride(1),
            head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    block_tables: torch.Tensor | None,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] (the chunks, packed) -> out of the same shape.

    block_tables None: no cached prefix; the keys are the chunks' own k, v
    [num_tokens, num_kv_heads, head_dim] (cu_seqlens_k == cu_seqlens_q). Otherwise the
    keys come from the paged cache, which must already hold this chunk's K/V."""
    assert_rows("q", q, 3)
    assert isinstance(max_seqlen_q, int) and max_seqlen_q >= 0, f"max_seqlen_q={max_seqlen_q!r}"
    num_seqs = cu_seqlens_q.shape[0] - 1
    assert_index("cu_seqlens_q", cu_seqlens_q, 1, num_seqs + 1, q.device)
    assert_index("cu_seqlens_k", cu_seqlens_k, 1, num_seqs + 1, q.device)
    if block_tables is None:
        for name, t in (("k", k), ("v", v)):
            assert_rows(name, t, 3, like=q)
            assert t.shape == (q.shape[0], *k.shape[1:]), f"{name}'s shape {tuple(t.shape)}"
        num_kv_heads = assert_heads(q, k.shape[1], k.shape[2], "k")
        keys, block_size, strides = (k, v), 1, (0, *k.stride()[:2], 0, *v.stride()[:2])
    else:
        num_kv_heads = assert_cache(k_cache, v_cache, like=q)
        assert_index("block_tables", block_tables, 2, num_seqs, q.device)
        keys, block_size, strides = (k_cache, v_cache), k_cache.shape[1], k_cache.stride()[:3] * 2
    out = _output_like(q, out)
    if num_seqs <= 0 or max_seqlen_q == 0:
        return out
    num_heads, head_dim = q.shape[1:]
    block_d = triton.next_power_of_2(head_dim)
    # 128 x 64 tiles (8 warps) for 16-bit d <= 128, as Hopper flash-attention kernels use;
    # 64-row tiles for a wide head; 32 for float32, whose 64-row tiles spill registers
    block_m = 32 if q.dtype == torch.float32 else 64 if block_d > 128 else 128
    tables = cu_seqlens_q if block_tables is None else block_tables  # unread when not PAGED
    _prefill_kernel[(triton.cdiv(max_seqlen_q, block_m), num_heads, num_seqs)](
        q,
        *keys,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        tables,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        tables.stride(0),
        *strides,
        scale * LOG2E,
        block_size,
        head_dim,
        GROUP=num_heads // num_kv_heads,
        PAGED=block_tables is not None,
        **_dot_options(q.dtype),
        BLOCK_M=block_m,
        BLOCK_N=_keys_per_tile(q.dtype, block_d),
        BLOCK_D=block_d,
        num_warps=8 if block_m == 128 else 4,
        num_stages=2,
    )
    return out


def _output_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    assert_rows("out", out, 3, like=q)
    assert out.shape == q.shape, f"out's shape {tuple(out.shape)} is not q's {tuple(q.shape)}"
    return out


def decode_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device
) -> int:
    """How many ways to split each sequence's keys: enough programs to fill the GPU twice
    over, each reading >= MIN_KEYS_PER_SPLIT keys, at most MAX_SPLITS. From shapes only,
    and a power of two: as an eager batch shrinks, the kernel compiles for few counts."""
    programs = max(1, num_seqs * num_kv_heads)
    by_occupancy = math.ceil(2 * _num_sms(device) / programs)
    by_length = math.ceil(max_context / MIN_KEYS_PER_SPLIT)
    splits = max(1, min(by_occupancy, by_length, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


@cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere (the interpreter gains
    nothing from splitting)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def _keys_per_tile(dtype: torch.dtype, block_d: int) -> int:
    """Keys per K/V tile: a 16 KiB tile (64 bf16 keys at head_dim 128), so two pipeline
    stages of K and V fit in shared memory beside a 128-row query tile."""
    return min(128, max(16, 16384 // (block_d * dtype.itemsize)))


def _dot_options(dtype: torch.dtype) -> dict:
    interpret = interpreted()
    return dict(
        DOT_F32=interpret, PRECISION="ieee" if interpret or dtype == torch.float32 else "tf32"
    )
