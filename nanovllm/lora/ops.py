"""The adapters' share of a LoRA layer's output, y += B_s (A_s x) for each row under slot s,
batched by slot: a hot op (compilation.py), so each platform runs its own. The eager one (a CPU's)
is two GEMMs per slot present over that slot's rows; CUDA's is the Triton kernels of
kernels/lora.py, which read each row's slot from the device (no host sync: capturable).
`lora_delta_reference` is the plain per-row definition the tests hold them to.

    a [slots, S * R, in]    every slot's A of each of the layer's S slices, rank padded to R
    b [slots, out, S * R]   every slot's B (scaled), slice j's in its rows and columns j*R..
"""

import torch

from nanovllm.compilation import HotOp
from nanovllm.lora.mapping import LoRAMapping


@HotOp
def lora_delta(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping
) -> torch.Tensor:
    """y [rows, out] with each adapter's share added (in place), x [rows, in]."""
    for group in mapping.groups:
        a_s, b_s = a[group.slot], b[group.slot]
        if group.rows is None:
            y += (x @ a_s.T) @ b_s.T
        else:
            y.index_add_(0, group.rows, (x[group.rows] @ a_s.T) @ b_s.T)
    return y


def lora_delta_reference(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Row by row, in float64: y[i] + B[slots[i]] @ (A[slots[i]] @ x[i]) where slots[i] >= 0."""
    out = y.double().clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[i] += b[slot].double() @ (a[slot].double() @ x[i].double())
    return out
