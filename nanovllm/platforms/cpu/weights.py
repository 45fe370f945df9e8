"""A CPU's weight format for float linears: a copy of the weight in oneDNN's blocked layout, whose
GEMM beats F.linear (MKL's) at decode sizes (docs/cpu.md#onednns-gemm-on-prepacked-weights). A
layer keeps its plain weight too: one float32 row goes through our own GEMV
(kernels/cpu_step.py), and a prefill chunk of more than PACKED_MAX_ROWS rows through F.linear."""

import logging

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import cpu_step
from nanovllm.layers.linear import FormattedWeight
from nanovllm.platforms.cpu.host import physical_memory

# Where the packed GEMM beats F.linear: docs/cpu.md#onednns-gemm-on-prepacked-weights.
PACKED_MAX_ROWS = 256
PACKED_MIN_WEIGHT = 2**16


class PackedWeight:
    """A layer's weight and its oneDNN-blocked copy (a WeightFormat, layers/linear.py)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.blocked = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > PACKED_MAX_ROWS:
            return F.linear(x, self.weight, bias)
        return cpu_step.packed_linear(x, self.weight, self.blocked, bias)


def pack_linear_weights(model: nn.Module, undo: bool = False) -> int:
    """Every float linear (the LM head too) of at least PACKED_MIN_WEIGHT elements reads a packed
    copy of its weight (`undo`: none does); a quantized one is left as it is. Returns how many."""
    packed = 0
    for module in model.modules():
        if isinstance(module, FormattedWeight) and not _quantized(module):
            pack = not undo and module.weight.numel() >= PACKED_MIN_WEIGHT
            module.set_weight_format(PackedWeight(module.weight.detach()) if pack else None)
            packed += pack
    return packed


def _quantized(module: FormattedWeight) -> bool:
    return module.weight_format is not None and not isinstance(module.weight_format, PackedWeight)


def pack_linear_weights_if_they_fit(model: nn.Module, tp_size: int) -> None:
    """Packed copies (faster GEMMs at decode sizes) when the copies of every rank fit in a
    quarter of the RAM; else, or where oneDNN cannot pack this dtype, F.linear alone. The
    choice is logged."""
    copies = tp_size * sum(p.numel() * p.element_size() for p in model.parameters())  # at most
    if not torch.backends.mkldnn.is_available():
        choice = "F.linear only (this PyTorch has no oneDNN)"
    elif copies > physical_memory() // 4:
        gib = copies / 2**30
        choice = (
            f"F.linear only ({gib:.1f} GiB of repacked copies would exceed a quarter of the RAM)"
        )
    else:
        try:
            choice = _described(pack_linear_weights(model), model)
        except RuntimeError as e:  # e.g. bfloat16 without avx512 / avx_ne_convert
            choice = f"F.linear only (oneDNN cannot repack them: {str(e).splitlines()[0]})"
            pack_linear_weights(model, undo=True)
    logging.getLogger("nanovllm").info("CPU linear layers: %s", choice)


def _described(packed: int, model: nn.Module) -> str:
    total = sum(isinstance(m, FormattedWeight) for m in model.modules())
    small = f"under {PACKED_MIN_WEIGHT:,} weights, too small to gain"
    if packed == 0:
        return f"F.linear for all {total} ({small} from oneDNN's layout)"
    return (
        f"{packed} of {total} read a copy of their weight in oneDNN's layout, faster at decode "
        f"sizes; the other {total - packed} ({small}) use F.linear"
    )
