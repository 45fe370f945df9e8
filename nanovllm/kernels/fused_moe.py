"""fused_moe: the experts of a mixture-of-experts layer as two grouped GEMMs.

Each token's top_k (token, slot) pairs, p = token * top_k + slot, are sorted by expert,
and each expert's group is padded to a multiple of BLOCK_M (padding rows hold p =
num_pairs, which reads zeros and writes nothing):

    sorted_ids  | e0 e0 e0 -- | e2 e2 -- -- | e3 e3 e3 e3 e3 -- -- -- | -- ...
    expert_ids  |     0       |      2      |     3      |     3      | -1 ...  (one per block)

so every BLOCK_M rows of sorted_ids belong to one expert and one program multiplies them
by that expert's weight, for both projections:

    gate_up[p] = x[p // top_k] @ w13[e].T                 [num_pairs, 2 * I]
    down[p]    = topk_weight[p] * (silu(gate) * up)[p] @ w2[e].T   [num_pairs, hidden]
    out[t]     = sum over the token's top_k slots of down  [num_tokens, hidden]

The sort is torch with shapes fixed by num_tokens (no host sync), so a decode step can
be captured in a CUDA graph. models/moe.py's fused_moe_torch is the reference.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels.layout import assert_index, assert_rows, interpreted


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    N,
    K,
    a_rows_per_pair,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,  # a [rows, K]; b [E, N, K]; c [num_pairs, N]
    MUL_WEIGHTS: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[p] = a[p // a_rows_per_pair] @ b[e].T (times weights[p]) for the BLOCK_M pairs p
    of this program's block, all of expert e; BLOCK_N output columns per program."""
    block = tl.program_id(0)
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    if expert < 0:  # past the last expert's pairs
        return
    pairs = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    a_rows = (pairs // a_rows_per_pair).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_rows = b_ptr + expert * stride_be + cols.to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_rows[None, :] + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0
        )  # [BLOCK_K, BLOCK_N]
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHTS:
        acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    c = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int | None = None,
) -> torch.Tensor:
    """hidden_states [num_tokens, hidden]; w13 [E, 2 * I, hidden] (gate | up); w2
    [E, hidden, I]; topk_weights, topk_ids [num_tokens, top_k]. Returns [num_tokens,
    hidden]. Expert ids must lie in [0, E) (the router's invariant; not checked here, as
    that would need a host sync)."""
    check_moe_args(hidden_states, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.empty_like(hidden_states)
    block_m = block_m or (16 if num_tokens * top_k <= 512 else 64)
    sorted_ids, expert_ids = align_by_expert(topk_ids, w13.shape[0], block_m)
    gate_up = _grouped_gemm(hidden_states, w13, sorted_ids, expert_ids, top_k, None, block_m)
    down = _grouped_gemm(
        _silu_and_mul(gate_up), w2, sorted_ids, expert_ids, 1, topk_weights, block_m
    )
    return down.view(num_tokens, top_k, -1).sum(dim=1)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids, expert_ids) as pictured above. Their lengths depend on the shape of
    topk_ids only: each expert that has pairs wastes fewer than block_m rows."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    experts = flat[order]
    rank_in_expert = (
        torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[experts]
    )
    length = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    length = -(-length // block_m) * block_m
    sorted_ids = torch.full((length,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_ids.scatter_(0, (padded_end - padded)[experts] + rank_in_expert, order)
    block_starts = torch.arange(0, length, block_m, device=flat.device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    return sorted_ids, torch.where(expert_ids < num_experts, expert_ids, -1)


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    a_rows_per_pair: int,
    topk_weights: torch.Tensor | None,
    block_m: int,
) -> torch.Tensor:
    """[num_pairs, N]: each pair's row of `a` times its expert's b [N, K]."""
    num_pairs = a.shape[0] * a_rows_per_pair
    N, K = b.shape[1], b.shape[2]
    c = torch.empty(num_pairs, N, dtype=a.dtype, device=a.device)
    block_n, block_k = (
        min(64, max(16, triton.next_power_of_2(n))) for n in (N, K)
    )  # tl.dot: >= 16
    grid = (expert_ids.shape[0], triton.cdiv(N, block_n))
    _grouped_gemm_kernel[grid](
        a,
        b,
        c,
        topk_weights if topk_weights is not None else c,
        sorted_ids,
        expert_ids,
        num_pairs,
        N,
        K,
        a_rows_per_pair,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        MUL_WEIGHTS=topk_weights is not None,
        DOT_F32=interpreted(),
        PRECISION="ieee" if interpreted() or a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return c


def check_moe_args(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """Our own layer's layouts, asserted (see kernels/layout.py)."""
    assert_rows("hidden_states", hidden_states, 2)
    num_tokens, hidden = hidden_states.shape
    for name, w in (("w13", w13), ("w2", w2)):
        assert_rows(name, w, 3, like=hidden_states)
        assert w.stride(1) == w.shape[2], f"{name} must be contiguous in its last two dims"
    intermediate = w2.shape[2]
    assert tuple(w13.shape) == (w2.shape[0], 2 * intermediate, hidden), (
        f"w13's shape {tuple(w13.shape)} does not fit w2's {tuple(w2.shape)}"
    )
    assert w2.shape[1] == hidden, f"w2's hidden size {w2.shape[1]} is not {hidden}"
    assert_index("topk_ids", topk_ids, 2, num_tokens, hidden_states.device)
    assert_rows("topk_weights", topk_weights, 2, like=hidden_states)
    assert topk_weights.shape == topk_ids.shape, (
        f"topk_weights' shape {tuple(topk_weights.shape)} is not topk_ids'"
    )
    assert hidden_states.is_contiguous() and topk_weights.is_contiguous(), (
        "hidden_states and topk_weights must be contiguous"
    )


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU between the projections: silu(gate) * up, [num_pairs, 2 * I] -> [num_pairs, I]
    (layers/activation.py's op, repeated here: a kernel module imports nothing of layers/)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
