"""Int4 weight-only quantization, group-wise, `LLM(path, quantization="int4")`: once the
checkpoint is loaded, each linear layer's weight (the LM head's too) is quantized per output
channel and group of GROUP_SIZE consecutive input channels to 4 bits with a float32 scale and
offset (kernels/cpu_int4.py's canonical form and its min-max rounding),

    w[n, k] ~ scale[n, g] * q[n, k] + offset[n, g]        q in 0..15, g = k // group_size

and its float weight freed. A layer's GEMM then reads half a byte a weight (an eighth of float32's,
half of int8's), through kernels/cpu_int4.cpp, without a float copy of the weight; past
KERNEL_MAX_ROWS rows (a prefill chunk) through a dequantized copy made for the call and F.linear.
Activations stay in the model's dtype. What stays float is int8's: the token embedding (a tied LM
head quantizes its own copy), Qwen3-MoE's router and experts. Checkpoints already quantized (GPTQ,
AWQ, GGUF) reach the same format through `Int4Weight(q, scale, offset, group_size, form)` (GGUF's
Q4_0 and Q4_K in forms of their own: kernels/cpu_int4.py). Imported only when quantization is asked
for, by a platform that runs it (a CPU's).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import cpu_int4, cpu_step
from nanovllm.layers.linear import FormattedWeight, ReplicatedLinear
from nanovllm.quantization.int8 import shared

GROUP_SIZE = 128  # GPTQ's and AWQ's usual group; a layer whose K it does not divide: see below

# Rows above which a dequantized float copy and F.linear beat the kernel, by how the kernel sums
# its byte products (benchmarks/cpu_int4.py --crossover, Qwen3-0.6B's layers, 1 thread, float32
# x, AMD EPYC Zen 4): with a dot-product instruction (AVX-512 VNNI), ~60 G multiply-adds/s, the
# kernel beat MKL's float32 GEMM alone (~47) at every count measured, and dequantize + F.linear
# by 2.4-3.0x at 128 rows, 1.0-1.3x at 2,048 (past it, x's digits would take 3 bytes a value
# per row: a prefill chunk of 16k rows, 150 MB); with AVX2's multiply-add pairs (its build, MKL
# at AVX2) 1.1-1.3x at 128 rows, 0.86-0.95x at 256; with plain loops (no AVX) the crossover
# is near 8 rows.
KERNEL_MAX_ROWS = {2: 2048, 1: 128, 0: 8}


class Int4Weight:
    """A layer's weight in group-quantized int4 (a WeightFormat, layers/linear.py), from the
    canonical tensors: q [N, K] uint8 in 0..15, scale and offset [N, K / group_size] float32,
    w = scale * q + offset per group, in one of the kernel's forms (SYMMETRIC: GGUF's Q4_0;
    SUB_SCALED with sub_scale and sub_offset [N, K / 32]: Q4_K; see kernels/cpu_int4.py)."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor,
        group_size: int,
        form: cpu_int4.Form = cpu_int4.Form.AFFINE,
        sub_scale: torch.Tensor | None = None,
        sub_offset: torch.Tensor | None = None,
    ):
        cpu_int4.check_format(q, scale, offset, group_size, form, sub_scale, sub_offset)
        if q.numel() and int(q.max()) > 15:
            raise ValueError(f"q must hold values 0..15, got {int(q.max())}")
        self.out_features, self.in_features = q.shape
        self.group_size, self.form = group_size, cpu_int4.Form(form)
        self.library = cpu_int4.load()
        subs = () if sub_scale is None else (sub_scale.contiguous(), sub_offset.contiguous())
        if self.library is None:
            self.packed, self.max_rows = None, 0
            self.tensors = (q.contiguous(), scale.contiguous(), offset.contiguous(), *subs)
        else:  # only the kernel's panels are kept: one copy, about half a byte a weight
            self.packed = cpu_int4.pack(q, scale, offset, group_size, form, *subs)
            self.max_rows = KERNEL_MAX_ROWS[self.library.nanovllm_int4_dot()]

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = GROUP_SIZE) -> "Int4Weight":
        """`weight` [N, K] quantized by cpu_int4.quantize (min-max per group)."""
        return cls(*cpu_int4.quantize(weight, group_size), group_size)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // max(self.in_features, 1)
        if rows > self.max_rows or x.dtype not in cpu_int4.DTYPES:
            return F.linear(x, self.dequantize().to(x.dtype), bias)
        return cpu_int4.linear(
            self.library, x, self.packed, self.out_features, self.group_size, bias, self.form
        )

    def native_linear(self, bias: torch.Tensor | None) -> cpu_step.Linear | None:
        """The kernel's panels, for the native decode step (platforms/cpu/decode_step.py)."""
        if self.packed is None:
            return None
        return cpu_step.Linear(
            self.packed,
            bias,
            None,
            self.out_features,
            self.in_features,
            self.group_size,
            self.form,
        )

    def canonical(self) -> tuple[torch.Tensor, ...]:
        """(q, scale, offset), and (sub_scale, sub_offset) after them where it has them: the
        tensors it was made from."""
        if self.packed is None:
            return self.tensors
        return cpu_int4.unpack(self.packed, self.out_features, self.group_size, self.form)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] it stands for (cpu_int4.dequantize)."""
        q, scale, offset, *subs = self.canonical()
        return cpu_int4.dequantize(q, scale, offset, self.group_size, *subs)


def quantize_int4(model: nn.Module, group_size: int = GROUP_SIZE) -> int:
    """Quantize every linear layer (and the LM head) of a loaded model in place, in groups of
    `group_size` input channels (see layer_group_size); the count."""
    cpu_int4.check_group_size(group_size, group_size)
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, ReplicatedLinear):
            continue  # an MoE router: see the top
        if isinstance(module, FormattedWeight):
            weight = module.weight.detach()
            size = layer_group_size(name, weight.shape[1], group_size)
            # a tied LM head keeps the embedding's float weight, which the lookup reads
            module.set_weight_format(
                Int4Weight.from_float(weight, size), keep_weight=shared(model, module.weight)
            )
            count += 1
    return count


def layer_group_size(name: str, in_features: int, group_size: int) -> int:
    """`group_size`, or for a layer whose in_features it does not divide the largest multiple of
    32 that divides both (a small model's 64 or 96 channels); a ValueError where there is none."""
    size = math.gcd(in_features, group_size)
    if size % 32:
        raise ValueError(
            f"{name}: in_features {in_features} has no group size that is a multiple of 32 "
            f"and divides group_size {group_size}: int4 needs groups of 32, 64, 128... channels"
        )
    return size
