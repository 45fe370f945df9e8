"""LoRA's batched GEMMs as Triton kernels, a row's adapter read from the device (so the launch
never syncs with the host and a CUDA graph can capture it): for each row i whose slot s = slots[i]
is >= 0,

    shrink   t[i] = a[s] @ x[i]        a [slots, W, K]    (W: every slice's rank, stacked)
    expand   y[i] += t[i] @ b[s]       b [slots, W, N]    (B transposed)

one program per (row, block of outputs), the weights read row by row as punica's "bgmv" does.
A row of slot -1 (the base model) loads and stores nothing."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.layout import assert_index, assert_rows


@triton.jit
def _bgmv_kernel(
    x_ptr,
    w_ptr,
    slots_ptr,
    out_ptr,
    N,
    K,
    stride_x,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_out,
    ACCUMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[i, n] (+)= sum_k w[slots[i], n, k] * x[i, k], for the program's block of n."""
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + row)
    # A row of slot -1 reads and writes nothing: its bounds are 0 (and its address slot 0's).
    n_end = tl.where(slot >= 0, N, 0)
    k_end = tl.where(slot >= 0, K, 0)
    slot = tl.maximum(slot, 0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + offs_k, mask=offs_k < k_end, other=0.0)
        w_mask = (offs_n[:, None] < n_end) & (offs_k[None, :] < k_end)
        w_offsets = slot * stride_ws + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
        w = tl.load(w_ptr + w_offsets, mask=w_mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    out_mask = offs_n < n_end
    out_offsets = out_ptr + row * stride_out + offs_n
    if ACCUMULATE:
        acc += tl.load(out_offsets, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _bgmv(
    x: torch.Tensor,
    w: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    transposed: bool,
) -> None:
    """out[i] (+)= w[s] @ x[i], w [slots, N, K]; or x[i] @ w[s], w [slots, K, N] (transposed)."""
    rows, k = x.shape
    n = w.shape[2] if transposed else w.shape[1]
    stride_wn, stride_wk = (w.stride(2), w.stride(1)) if transposed else (w.stride(1), w.stride(2))
    block_k = min(128, triton.next_power_of_2(k))
    block_n = min(64, triton.next_power_of_2(n))
    _bgmv_kernel[(rows, triton.cdiv(n, block_n))](
        x,
        w,
        slots,
        out,
        n,
        k,
        x.stride(0),
        w.stride(0),
        stride_wn,
        stride_wk,
        out.stride(0),
        ACCUMULATE=accumulate,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def lora_bgmv(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """y [rows, N] += (a[s] @ x[i]) @ b[s] for each row i of slot s = slots[i] >= 0, in place;
    x [rows, K], a [slots, W, K], b [slots, W, N] (contiguous), slots [rows] int32/int64."""
    assert_rows("x", x, 2)
    assert_rows("y", y, 2, like=x)
    assert_rows("a", a, 3, like=x)
    assert_rows("b", b, 3, like=x)
    rows, k = x.shape
    assert a.is_contiguous() and b.is_contiguous(), "a and b must be contiguous"
    assert a.shape[2] == k and b.shape[1] == a.shape[1] and b.shape[0] == a.shape[0], (
        f"a {tuple(a.shape)} and b {tuple(b.shape)} do not chain x [rows, {k}]"
    )
    assert y.shape == (rows, b.shape[2]), f"y must be [{rows}, {b.shape[2]}], got {tuple(y.shape)}"
    assert_index("slots", slots, 1, rows, x.device)
    if rows == 0:
        return y
    t = torch.zeros(rows, a.shape[1], dtype=torch.float32, device=x.device)
    _bgmv(x, a, slots, t, accumulate=False, transposed=False)
    _bgmv(t, b, slots, y, accumulate=True, transposed=True)
    return y
