"""Int8 weight-only linear on a CPU (W8A16): symmetric per-output-channel int8 weights, float32
or bfloat16 activations, y = x q^T * scale (+ bias) (cpu_int8.cpp). Each weight is read as one
byte: where the CPU has AVX-512 VNNI, x is written per block of 256 inputs in 24-bit fixed
point and multiplied by the bytes in integer dot products, exact, summed in float32 once a
block (from 16 inputs on); elsewhere each weight is widened to float32 in registers, once for a
tile of rows of x, and the sums are float32 ones (where the CPU has AMX, from 6 rows of
bfloat16 x or 12 of float32 on, a slice of a panel at a time is widened to bfloat16 tiles in
L1, x split exactly into bfloat16 parts). Nothing of the float weight is written back to memory.
Built at first use and loaded with ctypes (kernels/cpu_build.py); `load()` is None, with one
warning, where it cannot be.

    qweight, scale = quantize(weight)          # [N, K] int8, [N] float32
    packed = pack(qweight)                     # [ceil(N / 64), K, 64] int8: the kernel's panels
    y = linear(load(), x, packed, scale, N, bias)

`dequantize` is the float32 weight the int8 one stands for (the reference, and a prefill's
weight where dequantizing a layer and calling F.linear is faster, see benchmarks/cpu_int8.py).
"""

import ctypes
import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from nanovllm.kernels.cpu_build import load_library, native_flags

SOURCE = Path(__file__).with_name("cpu_int8.cpp")
# -ffp-contract=fast: x * w + acc is one FMA (-std=c++17 alone would turn that off).
FLAGS = native_flags("-ffp-contract=fast")
BLOCK = 64  # output channels a panel (cpu_int8.cpp's BLOCK)
DTYPES = (torch.float32, torch.bfloat16)
_INT, _I64, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library, built on first use; None (and a warning) if it cannot be.
    `extra_flags` (e.g. "-mno-avx512f", to build the AVX2 path on an AVX-512 CPU) are
    appended to FLAGS, a library of their own."""
    library = load_library(
        SOURCE, FLAGS + extra_flags, "int8 weights are dequantized to float32 for F.linear"
    )
    if library is not None:
        library.nanovllm_int8_linear.argtypes = (
            _PTR,
            _INT,
            _PTR,
            _PTR,
            _PTR,
            _PTR,
            _I64,
            _I64,
            _I64,
            _INT,
        )
        library.nanovllm_int8_linear.restype = None
        library.nanovllm_int8_amx_rows.argtypes = (_INT,)
        assert library.nanovllm_int8_block() == BLOCK, "cpu_int8.cpp's BLOCK changed"
    return library


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (qweight [N, K] int8, scale [N] float32), symmetric per output
    channel: scale = max |w_row| / 127 (1 for a row of zeros), q = round(w / scale) in
    [-127, 127]. In float32, so |w - q * scale| <= scale * (1/2 + 2^-17): the division's
    rounding is at most half an ulp of |w / scale| <= 127."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"weight must be a float tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out_features, in_features], got {tuple(weight.shape)}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    qweight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return qweight, scale


def pack(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [N, K] int8 -> [ceil(N / 64), K, 64] int8: panels of 64 output channels, a
    panel's weights of one input channel in one 64-byte line; the rows past N are zeros."""
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int8:
        raise TypeError(f"qweight must be an int8 tensor, got {getattr(qweight, 'dtype', qweight)}")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be [out_features, in_features], got {qweight.shape}")
    n, k = qweight.shape
    padded = F.pad(qweight, (0, 0, 0, -n % BLOCK))
    return padded.view(padded.shape[0] // BLOCK, BLOCK, k).transpose(1, 2).contiguous()


def dequantize(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that (qweight, scale) stands for."""
    return qweight.float() * scale.float()[:, None]


def linear(
    library: ctypes.CDLL,
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] float32 or bfloat16 -> [..., out_features] in x's dtype:
    y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] (+ bias[n]), summed in float32."""
    _check(x, packed, scale, out_features, bias)
    k = packed.shape[1]
    rows = (x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), k)).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    if bias is not None:
        bias = bias.float().contiguous()
    library.nanovllm_int8_linear(
        rows.data_ptr(),
        x.dtype == torch.bfloat16,
        packed.data_ptr(),
        scale.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        out_features,
        k,
        torch.get_num_threads(),
    )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def _check(x, packed, scale, out_features, bias) -> None:
    """What the C++ indexes by hand; a mismatch would read the wrong memory."""
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES or not x.is_cpu:
        raise TypeError(f"x must be a float32 or bfloat16 CPU tensor, got {_describe(x)}")
    if packed.dtype != torch.int8 or packed.dim() != 3 or not packed.is_contiguous():
        raise TypeError(f"packed must be pack()'s contiguous int8 tensor, got {_describe(packed)}")
    panels, k, block = packed.shape
    if block != BLOCK or not (panels - 1) * BLOCK < out_features <= panels * BLOCK:
        raise ValueError(f"packed {tuple(packed.shape)} does not hold {out_features} rows")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not end in in_features {k}")
    if scale.dtype != torch.float32 or scale.shape != (out_features,) or not scale.is_contiguous():
        raise ValueError(
            f"scale must be contiguous float32 [{out_features}], got {_describe(scale)}"
        )
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias must be [{out_features}], got {_describe(bias)}")


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"
