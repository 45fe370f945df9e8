"""Group-quantized int4 weight-only linear on a CPU (W4A16): float32 or bfloat16 activations,
4-bit weights with a float32 scale and offset per output channel and group of `group_size`
consecutive input channels (a multiple of 32 dividing K),

    w[n, k] = scale[n, g] * q[n, k] + offset[n, g]        q in 0..15 (uint8), g = k // group_size

the canonical form every int4 format maps to: symmetric int4 (offset = -8 scale), GPTQ and AWQ
(offset = -scale * zero), GGUF's Q4_0 (offset = -8 d) and Q4_K (scale d * sc, offset -dmin * m).
y = x w^T (+ bias) by cpu_int4.cpp, reading half a byte a weight: integer dot products of the
nibbles with x written in 24-bit fixed point per block of input channels (the C++ says how, and
what that rounds), summed per group in float32. Built at first use and loaded with ctypes
(kernels/cpu_build.py); `load()` is None, with one warning, where it cannot be.

    q, scale, offset = quantize(weight, group_size)     # [N, K] uint8, [N, K / G] float32 x 2
    packed = pack(q, scale, offset, group_size)         # the kernel's panels of 64 channels
    y = linear(load(), x, packed, N, group_size, bias)

`dequantize` is the float32 weight the int4 one stands for (the reference, and a prefill's
weight where dequantizing a layer and calling F.linear is faster); `unpack` undoes `pack`.
"""

import ctypes
import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from nanovllm.kernels.cpu_build import load_library, native_flags

SOURCE = Path(__file__).with_name("cpu_int4.cpp")
# -ffp-contract=fast: scale * d + acc is one FMA (-std=c++17 alone would turn that off).
FLAGS = native_flags("-ffp-contract=fast", "-fno-math-errno")
BLOCK = 64  # output channels a panel (cpu_int4.cpp's BLOCK)
LINE = 256  # bytes of a panel's 8 input channels (cpu_int4.cpp's LINE)
SCALES = 8 * BLOCK  # bytes of a group's scales and offsets, before its lines
DTYPES = (torch.float32, torch.bfloat16)
QUANTIZE_CHUNK = 1 << 22  # weights quantize() rounds at a time (an LM head: 155 M in Qwen3-0.6B)
_INT, _I64, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library, built on first use; None (and a warning) if it cannot be.
    `extra_flags` (e.g. "-mno-avx512f", to build the AVX2 path on an AVX-512 CPU) are
    appended to FLAGS, a library of their own."""
    library = load_library(
        SOURCE, FLAGS + extra_flags, "int4 weights are dequantized to float32 for F.linear"
    )
    if library is not None:
        library.nanovllm_int4_linear.argtypes = (
            _PTR,
            _INT,
            _PTR,
            _PTR,
            _PTR,
            _I64,
            _I64,
            _I64,
            _I64,
            _INT,
        )
        library.nanovllm_int4_linear.restype = None
        library.nanovllm_int4_x_block.argtypes = (_I64,)
        library.nanovllm_int4_x_block.restype = _I64
        assert library.nanovllm_int4_block() == BLOCK, "cpu_int4.cpp's BLOCK changed"
        assert library.nanovllm_int4_line() == LINE, "cpu_int4.cpp's LINE changed"
    return library


def check_group_size(group_size: int, in_features: int) -> None:
    """A group size the kernel takes for `in_features` input channels, else a ValueError."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 32 or group_size % 32:
        raise ValueError(f"group_size must be a positive multiple of 32, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")


def quantize(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (q [N, K] uint8 in 0..15, scale, offset [N, K / group_size]
    float32), asymmetric per group (min-max, as GGUF's Q4_1 and GPTQ's asymmetric grids):
    offset = the group's least weight, scale = (its greatest - its least) / 15 in float32 (0 for
    a constant group), q = the nearest step. All 16 levels span the group's own range (a
    symmetric grid, scale = max |w| / 7, spends one of them and a group's lopsided half), and
    nothing is clipped: |w - (scale q + offset)| <= scale (1/2 + 2^-20), the division's rounding
    in float64."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"weight must be a float tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out_features, in_features], got {tuple(weight.shape)}")
    n, k = weight.shape
    check_group_size(group_size, k)
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    offset = w.amin(dim=2) if k else w.new_zeros(n, 0)
    top = w.amax(dim=2) if k else w.new_zeros(n, 0)
    scale = ((top.double() - offset.double()) / 15).float()  # offset is a float32 weight: exact
    q = torch.empty(n, k, dtype=torch.uint8)
    rows = max(1, QUANTIZE_CHUNK // max(k, 1))  # float64 temporaries of a few rows at a time
    for r in range(0, n, rows):
        step = scale[r : r + rows].double().clamp_min(1e-300)[..., None]
        steps = (w[r : r + rows].double() - offset[r : r + rows].double()[..., None]) / step
        q[r : r + rows] = torch.round(steps).clamp_(0, 15).view(q[r : r + rows].shape)
    return q, scale, offset


def check_format(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int):
    """The canonical tensors' types and shapes (q's values are checked by pack)."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or q.dim() != 2:
        raise TypeError(f"q must be a uint8 [out_features, in_features] tensor, got {_describe(q)}")
    n, k = q.shape
    check_group_size(group_size, k)
    for name, t in (("scale", scale), ("offset", offset)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor, got {_describe(t)}")
        if t.shape != (n, k // group_size):
            raise ValueError(
                f"{name} must be [{n}, {k // group_size}] (one per row and group of "
                f"{group_size}), got {tuple(t.shape)}"
            )


def pack(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The canonical tensors -> the kernel's [ceil(N / 64), K / G, 512 + G / 8 * 256] uint8:
    per panel of 64 output channels and group, the group's 64 scales and 64 offsets as float32
    bytes, then G / 8 lines of 256 bytes (input channels k .. k + 7 of the 64 channels, 4 bytes
    a channel: byte i = q[k + i] | q[k + 4 + i] << 4); channels past N are zeros."""
    check_format(q, scale, offset, group_size)
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"q must hold values 0..15, got {int(q.max())}")
    n, k = q.shape
    groups, pad = k // group_size, -n % BLOCK
    panels = (n + pad) // BLOCK
    # [panel, channel, group, line, half, byte]: k = g G + 8 line + 4 half + byte
    q = F.pad(q, (0, 0, 0, pad)).view(panels, BLOCK, groups, group_size // 8, 2, 4)
    lines = q[..., 0, :] | (q[..., 1, :] << 4)
    lines = lines.permute(0, 2, 3, 1, 4).reshape(panels, groups, group_size // 8 * LINE)

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [N, groups] -> [panels, groups, 256] bytes
        t = F.pad(t, (0, 0, 0, pad)).view(panels, BLOCK, groups).transpose(1, 2).contiguous()
        return t.view(torch.uint8)

    return torch.cat([per_group(scale), per_group(offset), lines], dim=2).contiguous()


def unpack(
    packed: torch.Tensor, out_features: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack's inverse: (q [N, K] uint8, scale, offset [N, K / G] float32)."""
    panels, groups, _ = packed.shape
    lines = packed[..., SCALES:].reshape(panels, groups, group_size // 8, BLOCK, 1, 4)
    q = torch.cat([lines & 0xF, lines >> 4], dim=4)  # [panel, group, line, channel, half, byte]
    q = q.permute(0, 3, 1, 2, 4, 5).reshape(panels * BLOCK, groups * group_size)

    def per_group(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous().view(torch.float32)  # [panels, groups, 64]
        return t.transpose(1, 2).reshape(panels * BLOCK, groups)[:out_features]

    scale = per_group(packed[..., : 4 * BLOCK])
    offset = per_group(packed[..., 4 * BLOCK : SCALES])
    return q[:out_features].contiguous(), scale.contiguous(), offset.contiguous()


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The float32 weight [N, K] the canonical tensors stand for: scale * q + offset, in
    float32 (a product and a sum, each rounded)."""
    check_format(q, scale, offset, group_size)
    n, k = q.shape
    w = q.view(n, k // group_size, group_size).float() * scale[..., None] + offset[..., None]
    return w.view(n, k)


def linear(
    library: ctypes.CDLL,
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] float32 or bfloat16 -> [..., out_features] in x's dtype: x w^T (+ bias), w
    the packed weight (see cpu_int4.cpp for how the sums are made and rounded)."""
    _check(x, packed, out_features, group_size, bias)
    k = x.shape[-1]
    rows = (x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), k)).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    if bias is not None:
        bias = bias.float().contiguous()
    library.nanovllm_int4_linear(
        rows.data_ptr(),
        x.dtype == torch.bfloat16,
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        out_features,
        k,
        group_size,
        torch.get_num_threads(),
    )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def _check(x, packed, out_features, group_size, bias) -> None:
    """What the C++ indexes by hand; a mismatch would read the wrong memory."""
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES or not x.is_cpu:
        raise TypeError(f"x must be a float32 or bfloat16 CPU tensor, got {_describe(x)}")
    if packed.dtype != torch.uint8 or packed.dim() != 3 or not packed.is_contiguous():
        raise TypeError(f"packed must be pack()'s contiguous uint8 tensor, got {_describe(packed)}")
    panels, groups, group_bytes = packed.shape
    if group_bytes != SCALES + group_size // 8 * LINE or group_size % 32:
        raise ValueError(f"packed {tuple(packed.shape)} does not hold groups of {group_size}")
    if not (panels - 1) * BLOCK < out_features <= panels * BLOCK:
        raise ValueError(f"packed {tuple(packed.shape)} does not hold {out_features} rows")
    if x.dim() == 0 or x.shape[-1] != groups * group_size:
        raise ValueError(f"x {tuple(x.shape)} does not end in in_features {groups * group_size}")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias must be [{out_features}], got {_describe(bias)}")


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"
