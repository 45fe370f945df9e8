"""Int8 weight-only quantization, `LLM(path, quantization="int8")` (vLLM's argument): once the
checkpoint is loaded, each linear layer's weight (the LM head's too) is quantized symmetrically
per output channel,

    scale[n] = max_k |W[n, k]| / 127        q[n, k] = round(W[n, k] / scale[n])    int8

and its float weight freed. A layer's GEMM then reads the int8 weight, a quarter of float32's
bytes: y = x @ (q * scale)^T computed by kernels/cpu_int8.py without a float copy of the weight
(a decode step reads every weight once, so it is memory-bound), or, for prefill chunks of more
rows than the kernel pays at, by a dequantized copy made for the call. Activations stay in the
model's dtype. The token embedding stays float (a lookup reads a few rows; tied to the LM head, the
head quantizes its own copy). Qwen3-MoE's router (a replicated linear, tiny, and its scores pick
the experts) and experts (their GEMMs are not linear layers) stay float too, as in vLLM. Imported
only when quantization is asked for, by a platform that runs it (a CPU's).
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import cpu_int8, cpu_step
from nanovllm.layers.linear import FormattedWeight, ReplicatedLinear

# Rows (a prefill chunk) above which a dequantized float copy and F.linear beat the int8 kernel,
# by the kernel's vector width (benchmarks/cpu_int8.py, 1 thread, float32, Intel Xeon): with
# 16-float vectors (AVX-512, AMX or not) the kernel won to about 2,048 rows on Qwen3-0.6B's
# layers; with 8 (AVX2, emulated there) to about 128-256.
KERNEL_MAX_ROWS = {16: 2048, 8: 128}


class Int8Weight:
    """A layer's weight in int8 with its per-channel scales (a WeightFormat, layers/linear.py)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        qweight, self.scale = cpu_int8.quantize(weight)
        self.library = cpu_int8.load()
        if self.library is None:
            self.qweight, self.max_rows = qweight, 0
        else:  # only the kernel's panels are kept: one int8 copy
            self.qweight = cpu_int8.pack(qweight)
            self.max_rows = KERNEL_MAX_ROWS.get(self.library.nanovllm_int8_vector_width(), 128)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows or x.dtype not in cpu_int8.DTYPES:
            return F.linear(x, self.dequantize().to(x.dtype), bias)
        return cpu_int8.linear(self.library, x, self.qweight, self.scale, self.out_features, bias)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] it stands for."""
        return cpu_int8.dequantize(self.dense_qweight(), self.scale)

    def native_linear(self, bias: torch.Tensor | None) -> cpu_step.Linear | None:
        """The kernel's panels, for the native decode step (platforms/cpu/decode_step.py)."""
        if self.library is None:
            return None
        return cpu_step.Linear(self.qweight, bias, self.scale, self.out_features, self.in_features)

    def dense_qweight(self) -> torch.Tensor:
        """[N, K] int8, from the kernel's panels [ceil(N / 64), K, 64] where it has them."""
        if self.library is None:
            return self.qweight
        panels = self.qweight.transpose(1, 2).reshape(-1, self.in_features)
        return panels[: self.out_features]


def quantize_int8(model: nn.Module) -> int:
    """Quantize every linear layer (and the LM head) of a loaded model in place; the count."""
    count = 0
    for module in model.modules():
        if isinstance(module, ReplicatedLinear):
            continue  # an MoE router: see the top
        if isinstance(module, FormattedWeight):
            weight = module.weight.detach()
            # a tied LM head keeps the embedding's float weight, which the lookup reads
            module.set_weight_format(Int8Weight(weight), keep_weight=shared(model, module.weight))
            count += 1
    return count


def shared(model: nn.Module, weight: nn.Parameter) -> bool:
    """Another module holds `weight` too (the embedding, when the LM head is tied)."""
    holders = [m for m in model.modules() if any(p is weight for p in m.parameters(recurse=False))]
    return len(holders) > 1
