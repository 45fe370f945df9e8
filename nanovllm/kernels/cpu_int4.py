"""Group-quantized int4 weight-only linear on a CPU (W4A16): float32 or bfloat16 activations,
4-bit weights with a float32 scale and offset per output channel and group of `group_size`
consecutive input channels (a multiple of 32 dividing K),

    w[n, k] = scale[n, g] * q[n, k] + offset[n, g]        q in 0..15 (uint8), g = k // group_size

the canonical form every int4 format maps to: symmetric int4 (offset = -8 scale), GPTQ and AWQ
(offset = -scale * zero), GGUF's Q4_0 (offset = -8 d) and Q4_K (scale d, offset -dmin, with
integer sub-scales sc and m per 32 inputs: w = scale sc q + offset m). A `Form` says how the
kernel's panels hold the scales, each exact for what it serves and the two last with fewer
bytes a weight and less float work: AFFINE (float32 scale and offset), SYMMETRIC (a float16
scale, offset -8 scale: Q4_0), SUB_SCALED (Q4_K's). y = x w^T (+ bias) by cpu_int4.cpp, reading
about half a byte a weight: integer dot products of the nibbles with x written in 24-bit fixed
point per block of input channels (the C++ says how, and what that rounds), summed per group in
float32. Built at first use and loaded with ctypes (kernels/cpu_build.py); `load()` is None,
with one warning, where it cannot be.

    q, scale, offset = quantize(weight, group_size)     # [N, K] uint8, [N, K / G] float32 x 2
    packed = pack(q, scale, offset, group_size)         # the kernel's panels of 64 channels
    y = linear(load(), x, packed, N, group_size, bias)
    packed = pack(q, d, -dmin, 256, Form.SUB_SCALED, sc, m)          # sc, m [N, K / 32] uint8
    y = linear(load(), x, packed, N, 256, bias, Form.SUB_SCALED)

`dequantize` is the float32 weight the int4 one stands for (the reference, and a prefill's
weight where dequantizing a layer and calling F.linear is faster); `unpack` undoes `pack`.
"""

import ctypes
import enum
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
SCALES = 8 * BLOCK  # bytes of a float32 scale and offset a channel
SUB = 32  # inputs of a sub-block (cpu_int4.cpp's SUB)
DTYPES = (torch.float32, torch.bfloat16)
QUANTIZE_CHUNK = 1 << 22  # weights quantize() rounds at a time (an LM head: 155 M in Qwen3-0.6B)
_INT, _I64, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


class Form(enum.IntEnum):
    """How a packed weight holds its scales, per output channel and group (cpu_int4.cpp's Form).
    Each is exact for the formats it serves; the two last store fewer bytes a weight than
    AFFINE at their group size, and SUB_SCALED turns its sums to float once a group of 256, not
    once every 32 inputs:

        AFFINE      scale, offset float32              w = scale q + offset        0.75 B at G 32
        SYMMETRIC   scale float16, offset -8 scale     w = scale (q - 8)           0.5625 (Q4_0)
        SUB_SCALED  scale, offset float32; per 32      w = scale sc q + offset m   0.59375 (Q4_K,
                    inputs sc, m in 0..63 (bytes)                                  G 256)
    """

    AFFINE = 0
    SYMMETRIC = 1
    SUB_SCALED = 2


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
            _INT,
        )
        library.nanovllm_int4_linear.restype = None
        library.nanovllm_int4_header_bytes.argtypes = (_I64, _INT)
        library.nanovllm_int4_header_bytes.restype = _I64
        library.nanovllm_int4_x_block.argtypes = (_I64,)
        library.nanovllm_int4_x_block.restype = _I64
        assert library.nanovllm_int4_block() == BLOCK, "cpu_int4.cpp's BLOCK changed"
        assert library.nanovllm_int4_line() == LINE, "cpu_int4.cpp's LINE changed"
        for form in Form:
            assert library.nanovllm_int4_header_bytes(256, form) == header_bytes(256, form)
    return library


def header_bytes(group_size: int, form: Form = Form.AFFINE) -> int:
    """Bytes of a group's scales in a panel, before its lines."""
    if form == Form.SYMMETRIC:
        return 2 * BLOCK
    if form == Form.SUB_SCALED:
        return SCALES + group_size // SUB * 2 * BLOCK
    return SCALES


def bytes_per_weight(group_size: int, form: Form = Form.AFFINE) -> float:
    """What a packed weight stores a weight: half a byte and its group's share of the scales."""
    return 0.5 + header_bytes(group_size, form) / (BLOCK * group_size)


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


def check_format(
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
    form: Form = Form.AFFINE,
    sub_scale: torch.Tensor | None = None,
    sub_offset: torch.Tensor | None = None,
) -> None:
    """The canonical tensors' types and shapes, and what the form asks of their values (q's
    are checked by pack): SYMMETRIC's scale float16 values and offset -8 scale; SUB_SCALED's
    sub_scale and sub_offset uint8 [N, K / 32] in 0..63, given for that form alone."""
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
    form = Form(form)
    subs = (("sub_scale", sub_scale), ("sub_offset", sub_offset))
    if form != Form.SUB_SCALED:
        if sub_scale is not None or sub_offset is not None:
            raise ValueError(f"sub_scale and sub_offset are SUB_SCALED's; form is {form.name}")
    else:
        for name, t in subs:
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != torch.uint8
                or t.shape != (n, k // SUB)
            ):
                raise TypeError(
                    f"{name} must be a uint8 [{n}, {k // SUB}] tensor, got {_describe(t)}"
                )
            if t.numel() and int(t.max()) > 63:
                raise ValueError(f"{name} must hold values 0..63, got {int(t.max())}")
    if form == Form.SYMMETRIC:
        if not torch.equal(scale.half().float(), scale):
            raise ValueError("SYMMETRIC's scale must hold float16 values (it is stored in 2 bytes)")
        if not torch.equal(offset, -8 * scale):
            raise ValueError("SYMMETRIC's offset must be -8 scale (it is not stored)")


def pack(
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
    form: Form = Form.AFFINE,
    sub_scale: torch.Tensor | None = None,
    sub_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """The canonical tensors -> the kernel's [ceil(N / 64), K / G, header + G / 8 * 256] uint8:
    per panel of 64 output channels and group, the group's header (header_bytes: AFFINE's 64
    scales and 64 offsets as float32 bytes; SYMMETRIC's 64 scales as float16; SUB_SCALED's
    scales and offsets, then per sub-block of 32 inputs its 64 sub_scales and 64 sub_offsets,
    a byte each), then G / 8 lines of 256 bytes (input channels k .. k + 7 of the 64 channels,
    4 bytes a channel: byte i = q[k + i] | q[k + 4 + i] << 4); channels past N are zeros."""
    check_format(q, scale, offset, group_size, form, sub_scale, sub_offset)
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"q must hold values 0..15, got {int(q.max())}")
    n, k = q.shape
    groups, pad = k // group_size, -n % BLOCK
    panels = (n + pad) // BLOCK
    # [panel, channel, group, line, half, byte]: k = g G + 8 line + 4 half + byte
    q = F.pad(q, (0, 0, 0, pad)).view(panels, BLOCK, groups, group_size // 8, 2, 4)
    lines = q[..., 0, :] | (q[..., 1, :] << 4)
    lines = lines.permute(0, 2, 3, 1, 4).reshape(panels, groups, group_size // 8 * LINE)

    def per_group(t: torch.Tensor, c: int = 1) -> torch.Tensor:  # [N, groups c] -> bytes
        t = F.pad(t, (0, 0, 0, pad)).view(panels, BLOCK, groups, c).permute(0, 2, 3, 1)
        return t.contiguous().view(torch.uint8).reshape(panels, groups, c * BLOCK * t.itemsize)

    if form == Form.SYMMETRIC:
        header = [per_group(scale.half())]
    elif form == Form.SUB_SCALED:  # per sub-block: its 64 sub_scales, then its 64 sub_offsets
        subs = torch.stack([sub_scale, sub_offset], dim=2).view(n, k // SUB * 2)
        header = [per_group(scale), per_group(offset), per_group(subs, group_size // SUB * 2)]
    else:
        header = [per_group(scale), per_group(offset)]
    return torch.cat([*header, lines], dim=2).contiguous()


def unpack(
    packed: torch.Tensor, out_features: int, group_size: int, form: Form = Form.AFFINE
) -> tuple[torch.Tensor, ...]:
    """pack's inverse: (q [N, K] uint8, scale, offset [N, K / G] float32), and for SUB_SCALED
    (sub_scale, sub_offset [N, K / 32] uint8) after them."""
    panels, groups, _ = packed.shape
    start = header_bytes(group_size, form)
    lines = packed[..., start:].reshape(panels, groups, group_size // 8, BLOCK, 1, 4)
    q = torch.cat([lines & 0xF, lines >> 4], dim=4)  # [panel, group, line, channel, half, byte]
    q = q.permute(0, 3, 1, 2, 4, 5).reshape(panels * BLOCK, groups * group_size)

    def per_group(begin: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        t = packed[..., begin:end].contiguous().view(dtype)  # [panels, groups, c x 64]
        c = (end - begin) // dtype.itemsize // BLOCK
        t = t.view(panels, groups, c, BLOCK).permute(0, 3, 1, 2)
        return t.reshape(panels * BLOCK, groups * c)[:out_features].contiguous()

    q = q[:out_features].contiguous()
    if form == Form.SYMMETRIC:
        scale = per_group(0, 2 * BLOCK, torch.float16).float()
        return q, scale, -8 * scale
    scale = per_group(0, 4 * BLOCK, torch.float32)
    offset = per_group(4 * BLOCK, SCALES, torch.float32)
    if form != Form.SUB_SCALED:
        return q, scale, offset
    subs = per_group(SCALES, start, torch.uint8).view(out_features, -1, 2)  # [N, K / 32, 2]
    return q, scale, offset, subs[..., 0].contiguous(), subs[..., 1].contiguous()


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
    sub_scale: torch.Tensor | None = None,
    sub_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float32 weight [N, K] the canonical tensors stand for: scale * q + offset, or with
    sub-scales (scale * sub_scale) * q + offset * sub_offset, in float32 (each product and the
    sum rounded; for GGUF's float16 scales and 6-bit sub-scales the products are exact and w
    is ggml's value)."""
    n, k = q.shape
    if sub_scale is None:
        check_format(q, scale, offset, group_size)
        w = q.view(n, k // group_size, group_size).float() * scale[..., None] + offset[..., None]
        return w.view(n, k)
    check_format(q, scale, offset, group_size, Form.SUB_SCALED, sub_scale, sub_offset)
    scales = scale.repeat_interleave(group_size // SUB, dim=1) * sub_scale.float()
    offsets = offset.repeat_interleave(group_size // SUB, dim=1) * sub_offset.float()
    w = q.view(n, k // SUB, SUB).float() * scales[..., None] + offsets[..., None]
    return w.view(n, k)


def linear(
    library: ctypes.CDLL,
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    form: Form = Form.AFFINE,
) -> torch.Tensor:
    """x [..., K] float32 or bfloat16 -> [..., out_features] in x's dtype: x w^T (+ bias), w
    the packed weight (see cpu_int4.cpp for how the sums are made and rounded)."""
    _check(x, packed, out_features, group_size, bias, form)
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
        form,
        torch.get_num_threads(),
    )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def _check(x, packed, out_features, group_size, bias, form) -> None:
    """What the C++ indexes by hand; a mismatch would read the wrong memory."""
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES or not x.is_cpu:
        raise TypeError(f"x must be a float32 or bfloat16 CPU tensor, got {_describe(x)}")
    if packed.dtype != torch.uint8 or packed.dim() != 3 or not packed.is_contiguous():
        raise TypeError(f"packed must be pack()'s contiguous uint8 tensor, got {_describe(packed)}")
    panels, groups, group_bytes = packed.shape
    form = Form(form)
    if group_bytes != header_bytes(group_size, form) + group_size // 8 * LINE or group_size % 32:
        raise ValueError(
            f"packed {tuple(packed.shape)} does not hold groups of {group_size} in the "
            f"{form.name} form"
        )
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
