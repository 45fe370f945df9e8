"""The adapters' share of a LoRA layer's output, y += B_s (A_s x) for each row under slot s,
batched by slot: a hot op (compilation.py), so each platform runs its own. The eager one (a
CPU's for a prefill's many rows; a decode step's take one C++ call, platforms/cpu/ops.py) is two
GEMMs per slot present over that slot's rows; CUDA's is the Triton kernels of kernels/lora.py,
which read each row's slot from the device (no host sync: capturable).
`lora_delta_reference` is the plain per-row definition the tests hold them to.

    a [slots, S * R, in]    every slot's A of each of the layer's S slices, rank padded to R
    b [slots, S * R, out]   every slot's B transposed (scaled), slice j's in its rows j*R ..
                            (j+1)*R and columns slice_ends[j - 1] .. slice_ends[j], zeros
                            elsewhere
"""

import torch

from nanovllm.compilation import HotOp
from nanovllm.lora.mapping import LoRAMapping


@HotOp
def lora_delta(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    mapping: LoRAMapping,
    slice_ends: torch.Tensor,
) -> torch.Tensor:
    """y [rows, out] with each adapter's share added (in place), x [rows, in]. `slice_ends`
    [S] (host): where each slice's outputs end, for implementations that skip b's zero blocks."""
    for group in mapping.groups:
        a_s, b_s = a[group.slot], b[group.slot]
        if group.rows is None:
            y += (x @ a_s.T) @ b_s
        else:
            y.index_add_(0, group.rows, (x[group.rows] @ a_s.T) @ b_s)
    return y


def lora_delta_reference(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Row by row, in float64: y[i] + b[s].T @ (a[s] @ x[i]) for each row of slot s >= 0."""
    out = y.double().clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[i] += b[slot].double().T @ (a[slot].double() @ x[i].double())
    return out
