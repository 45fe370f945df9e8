"""The hot ops between the matmuls as one Triton kernel each: RMSNorm (alone, over each head of q
or k, or after the residual add), SiLU-and-mul and rotary embedding on q and k together.

Each launcher has the signature and the result of the eager op it stands for
(layers/layernorm.py, layers/activation.py, layers/rotary_embedding.py), and its roundings:
every intermediate result the eager op stores in the input dtype is rounded to it here too
(round to nearest even), the rest is computed in float32. So a bfloat16 or float16 result
differs from the eager one only where float32 math differs (a sum in another order, exp or
rsqrt a unit off), by at most one rounding; the rotary embedding, products and sums of 16-bit
numbers, is bit-equal. Each reads its input once and writes its output once.

    rms_norm(x, weight, eps)                 weight * normed(x): x [tokens, hidden] or
                                             [tokens, heads, head_dim]
    add_rms_norm(x, residual, weight, eps)   (rms_norm(x + residual), x + residual)
    silu_and_mul(x)                          silu(x[:, :d]) * x[:, d:]
    apply_rotary_emb(positions, q, k, cos_sin_cache)   (q, k) rotated, "rotate half"
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.layout import assert_index, assert_rows

MAX_ROWS = 16  # a norm program normalizes up to this many rows ...
ROW_ELEMENTS = 2048  # ... of at most this many elements in all


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """float32 `x` rounded to DTYPE (to nearest even) and back. bfloat16 is rounded by hand:
    Triton's interpreter truncates a float32 cast to it, the GPU rounds, and both then agree."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE).to(tl.float32)


# -- RMSNorm ----------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    num_rows,
    num_heads,  # rows are (token, head) pairs; 1 for [tokens, hidden]
    hidden,
    stride_xt,
    stride_xh,
    stride_rt,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    token, head = (rows // num_heads).to(tl.int64), rows % num_heads
    x_at = token[:, None] * stride_xt + head[:, None] * stride_xh + cols[None, :]
    out_at = rows.to(tl.int64)[:, None] * hidden + cols[None, :]  # out, sum: contiguous
    x = tl.load(x_ptr + x_at, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:  # the sum in the input dtype, as transformers adds
        r = tl.load(residual_ptr + token[:, None] * stride_rt + cols[None, :], mask=mask, other=0.0)
        x = _round(x + r.to(tl.float32), dtype)
        tl.store(sum_ptr + out_at, x.to(dtype), mask=mask)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)  # [ROWS]
    normed = _round(x * inv[:, None], dtype)
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_at, _round(w[None, :] * normed, dtype).to(dtype), mask=mask)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    assert x.dim() in (2, 3), f"x must be [tokens, hidden] or [tokens, heads, dim], got {x.shape}"
    assert_rows("x", x, x.dim())
    assert_rows("weight", weight, 1, like=x)
    hidden = x.shape[-1]
    assert weight.shape[0] == hidden, f"weight's {weight.shape[0]} is not x's last dim {hidden}"
    num_heads = x.shape[1] if x.dim() == 3 else 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else out
    if residual is not None:
        assert x.dim() == 2, "the residual add is over [tokens, hidden]"
        assert_rows("residual", residual, 2, like=x)
        assert residual.shape == x.shape, f"residual {residual.shape} is not x's {x.shape}"
    num_rows = x.shape[0] * num_heads
    if num_rows == 0:
        return out, summed
    block = triton.next_power_of_2(hidden)
    rows = max(1, min(MAX_ROWS, ROW_ELEMENTS // block))
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        summed,
        num_rows,
        num_heads,
        hidden,
        x.stride(0),
        x.stride(1) if x.dim() == 3 else 0,
        residual.stride(0) if residual is not None else 0,
        eps,
        HAS_RESIDUAL=residual is not None,
        ROWS=rows,
        BLOCK=block,
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [tokens, hidden] or [tokens, heads, head_dim] (a view of the qkv projection will do:
    its last dim contiguous); weight [x's last dim]. A new contiguous tensor like x."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [tokens, hidden]: (rms_norm(x + residual), x + residual), both new."""
    return _norm(x, residual, weight, eps)


# -- SiLU-and-mul -----------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_xt, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_xt + d + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    silu = _round(g / (1.0 + tl.exp(-g)), dtype)  # F.silu's result, in the input dtype
    tl.store(
        out_ptr + token * d + cols, _round(silu * up.to(tl.float32), dtype).to(dtype), mask=mask
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * d] (gate | up) -> [tokens, d], new and contiguous."""
    assert_rows("x", x, 2)
    assert x.shape[1] % 2 == 0, f"x's last dim must be even (gate | up), got {x.shape[1]}"
    tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(tokens, d, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block = min(triton.next_power_of_2(d), 1024)
    _silu_and_mul_kernel[(tokens, triton.cdiv(d, block))](x, out, d, x.stride(0), BLOCK=block)
    return out


# -- rotary embedding -------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, stride_xh, num_heads, cos, sin, dims, half, head_dim, BLOCK_H: tl.constexpr
):
    """One token's heads of q or k: x * (cos | cos) + (x2 | x1) * (-sin | sin), each product
    and the sum rounded to the input dtype as the eager op's are; out rows are head_dim apart."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < num_heads) & (dims < head_dim)
    x = tl.load(x_ptr + heads * stride_xh + dims, mask=mask, other=0.0)
    swapped = tl.load(x_ptr + heads * stride_xh + (dims + half) % head_dim, mask=mask, other=0.0)
    dtype = x.dtype
    rotated = _round(swapped.to(tl.float32) * sin, dtype) + _round(x.to(tl.float32) * cos, dtype)
    tl.store(out_ptr + heads * head_dim + dims, _round(rotated, dtype).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cp,
    num_heads,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)[None, :]
    at = cache_ptr + position * stride_cp + dims  # [2, head_dim]: (cos | cos), (-sin | sin)
    cos = tl.load(at, mask=dims < head_dim, other=0.0)
    sin = tl.load(at + head_dim, mask=dims < head_dim, other=0.0)
    dtype = q_ptr.dtype.element_ty
    cos, sin = _round(cos, dtype), _round(sin, dtype)  # the eager op's .to(q.dtype)
    out = out_ptr + token * (num_heads + num_kv_heads) * head_dim
    half = head_dim // 2
    _rotate_heads(
        q_ptr + token * stride_qt,
        out,
        stride_qh,
        num_heads,
        cos,
        sin,
        dims,
        half,
        head_dim,
        BLOCK_H,
    )
    _rotate_heads(
        k_ptr + token * stride_kt,
        out + num_heads * head_dim,
        stride_kh,
        num_kv_heads,
        cos,
        sin,
        dims,
        half,
        head_dim,
        BLOCK_H,
    )


def apply_rotary_emb(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [tokens]; q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim] (views of
    the qkv projection will do); cos_sin_cache [max_position, 2, head_dim] float32. (q, k)
    rotated: views of one new [tokens, heads + kv_heads, head_dim] tensor, as the eager op's."""
    assert_rows("q", q, 3)
    assert_rows("k", k, 3, like=q)
    tokens, num_heads, head_dim = q.shape
    assert k.shape[0] == tokens and k.shape[2] == head_dim, f"k {k.shape} does not fit q {q.shape}"
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    assert_index("positions", positions, 1, tokens, q.device)
    assert (
        cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[1:] == (2, head_dim)
        and cos_sin_cache.device == q.device
    ), f"cos_sin_cache must be contiguous float32 [max_position, 2, {head_dim}] on {q.device}"
    num_kv_heads = k.shape[1]
    out = torch.empty(tokens, num_heads + num_kv_heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens > 0:
        _rotary_kernel[(tokens,)](
            positions,
            q,
            k,
            cos_sin_cache,
            out,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos_sin_cache.stride(0),
            num_heads,
            num_kv_heads,
            head_dim,
            BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv_heads)),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out.split((num_heads, num_kv_heads), dim=1)
