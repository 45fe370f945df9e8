"""The CPU's group-quantized int4 linear (nanovllm/kernels/cpu_int4.py) against a float64 product
of x and the weights it stands for, w = scale * q + offset (float64, unrounded).

The kernel's error, from how it computes (cpu_int4.cpp): x is rounded per block of B input
channels (B = the group, at most 1024) to 23 bits below the block's largest |x|, at most
2^-23 max_b |x| / 0.996 an element (max_b |x| taken as 2^-100 at least); the integer products
and sums are exact; each block adds a rounding to d and one to its sum(X), and its two additions
to the row's total two more, each at most u = 2^-24 of a partial total no larger than

    A = sum_k (|scale| q + |offset|) (|x_k| + 2^-14 max_b |x|)

(q unsigned, so before offsets cancel; the 2^-14 covers the rounded x and its digits), and the
bias one more. So

    |y - exact| <= 2^-23 / 0.996 sum_k |w_k| max_b |x| + (2 blocks + 5) u (A + |bias|)

and without FMA (the generic build, 4 lanes), where each addition to the total is two
roundings, 4 blocks + 5. A bfloat16 output adds its rounding, half an ulp: at most 2^-8 |y|.
The errors measured reach about a fifth of the bound. Shapes on and around the kernel's limits:
64-channel panels, vectors of 16 (AVX-512), 8 (AVX2) or 4 channels, tiles of 1, 2 and 8 rows,
groups of 32, 128 and 2048 (x in blocks of 1024). The builds without VNNI, without AVX-512 and
without AVX are tested here too where the CPU runs them (x86: -mno-avx512vnni, -mno-avx512f,
-mno-avx)."""

import functools
import platform

import pytest
import torch
from conftest import native_library

from nanovllm.kernels import cpu_int4

U = 2.0**-24
CHANNELS = (1, 15, 16, 17, 33, 64, 65, 129)  # N
GROUPS = ((32, 32), (96, 32), (128, 32), (128, 128), (384, 128), (2048, 2048))  # (K, G)
ROWS = (1, 2, 3, 5, 8, 9, 16, 17, 33, 300)  # M
X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture
def library():
    return native_library(cpu_int4.load)


def randn(*shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@functools.cache
def int4_layer(n: int, k: int, group_size: int, seed: int = 1, bias: bool = True):
    """(q, scale, offset, packed, bias) of a random [n, k] weight (made once: tests only read
    it), each row at another scale."""
    weight = randn(n, k, seed=seed) * torch.logspace(-2, 2, n)[:, None]
    q, scale, offset = cpu_int4.quantize(weight, group_size)
    packed = cpu_int4.pack(q, scale, offset, group_size)
    return q, scale, offset, packed, randn(n, seed=seed + 1) if bias else None


def per_channel(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, groups] -> [N, K] float64: each group's value on its channels."""
    return t.double().repeat_interleave(group_size, dim=1)


def error_bound(library, x, q, scale, offset, group_size, bias) -> torch.Tensor:
    """The bound of the module's doc for every output [M, N] (before a bfloat16 rounding)."""
    x = x.double()
    k = x.shape[1]
    block = library.nanovllm_int4_x_block(group_size)
    blocks = k // block
    amax = x.abs().view(-1, blocks, block).amax(dim=2).repeat_interleave(block, dim=1)  # [M, K]
    amax = amax.clamp(min=2.0**-100)  # the smallest step's blocks
    s, o = per_channel(scale, group_size), per_channel(offset, group_size)
    weight = s * q.double() + o
    magnitude = (x.abs() + 2.0**-14 * amax) @ (s.abs() * q.double() + o.abs()).T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    roundings = (4 if library.nanovllm_int4_vector_width() == 4 else 2) * blocks + 5
    # x's rounding: half a step, step <= 2^-23 amax, or 2^-22 amax where amax's 24-bit X would
    # not fit three digits (amax within 0.4% under a power of two, so 2^-23 amax / 0.996)
    return 2.0**-23 / 0.996 * (amax @ weight.abs().T) + roundings * U * magnitude


def assert_close_to_exact(library, y, x, q, scale, offset, group_size, bias) -> None:
    weight = per_channel(scale, group_size) * q.double() + per_channel(offset, group_size)
    exact = x.double() @ weight.T
    if bias is not None:
        exact = exact + bias.double()
    bound = error_bound(library, x, q, scale, offset, group_size, bias)
    assert_within(y, exact, bound, f"{tuple(x.shape)} x {tuple(q.shape)} (groups of {group_size})")


def assert_within(y, exact, bound, case: str) -> None:
    """|y - exact| within `bound` everywhere (a bfloat16 y: and its own rounding)."""
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * (exact.abs() + bound)
    error = (y.double() - exact).abs()
    worst = (error - bound).argmax()
    assert (error <= bound).all(), (
        f"{case}: error {error.flatten()[worst]:.3g} over the bound "
        f"{bound.flatten()[worst]:.3g} at {divmod(int(worst), exact.shape[1])}"
    )


def check_shapes(library, dtype, rows) -> None:
    """Every (N, K, G) of the grid at `rows` rows, with a bias on every other one; x's columns
    at scales 10^-3..10^3 (a block's small values are the ones its fixed point rounds most)."""
    for i, n in enumerate(CHANNELS):
        for j, (k, group_size) in enumerate(GROUPS):
            q, scale, offset, packed, bias = int4_layer(n, k, group_size, i + j, (i + j) % 2 == 0)
            x = randn(rows, k, seed=rows) * torch.logspace(-3, 3, k)[torch.randperm(k)]
            x = x.to(dtype)
            y = cpu_int4.linear(library, x, packed, n, group_size, bias)
            assert y.dtype == dtype and y.shape == (rows, n)
            assert_close_to_exact(library, y, x, q, scale, offset, group_size, bias)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows", ROWS)
def test_linear_is_the_product_with_the_dequantized_weight(library, dtype, rows):
    check_shapes(library, dtype, rows)


def other_build(library, flag: str, width: int):
    """The kernel built for this CPU with `flag` (another CPU's path, of `width` lanes); a skip
    where this CPU's own build already is that path."""
    if library.nanovllm_int4_vector_width() < width:
        pytest.skip(f"this CPU's own build already has {width}-lane vectors or fewer")
    if width == 16 and library.nanovllm_int4_dot() < 2:
        pytest.skip("this CPU's own build already runs without VNNI")
    other = native_library(lambda: cpu_int4.load((flag,)))
    assert other.nanovllm_int4_vector_width() == width
    return other


@pytest.mark.parametrize(
    "flag,width,dot", [("-mno-avx512vnni", 16, 1), ("-mno-avx512f", 8, None), ("-mno-avx", 4, 0)]
)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.skipif(not X86, reason="x86 flags")
def test_the_vnni_free_avx2_and_generic_builds_are_the_product_too(
    library, flag, width, dot, dtype
):
    """Built for this CPU without VNNI (AVX-512's multiply-add pairs), without AVX-512 (AVX2,
    with AVX-VNNI where the CPU has it) or without AVX (plain loops): other CPUs' paths."""
    other = other_build(library, flag, width)
    assert dot is None or other.nanovllm_int4_dot() == dot
    for rows in (1, 2, 3, 9, 17):
        check_shapes(other, dtype, rows)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_a_rows_result_does_not_depend_on_the_other_rows(library, dtype):
    """1, 2 and 8-row tiles and a last, shorter tile: a row's bits are those it gets alone."""
    q, scale, offset, packed, bias = int4_layer(129, 384, 128)
    x = randn(19, 384, dtype=dtype)
    together = cpu_int4.linear(library, x, packed, 129, 128, bias)
    for m in range(19):
        alone = cpu_int4.linear(library, x[m : m + 1], packed, 129, 128, bias)
        assert torch.equal(alone[0], together[m]), m
    pair = cpu_int4.linear(library, x[3:5], packed, 129, 128, bias)
    assert torch.equal(pair, together[3:5])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows,n,k", [(1, 1000, 384), (2, 700, 512), (64, 257, 384)])
def test_one_and_two_threads_give_the_same_bits(library, dtype, rows, n, k):
    """Large enough to be spread over the threads; each output is one thread's sum in the
    same order either way."""
    _, _, _, packed, bias = int4_layer(n, k, 128)
    x = randn(rows, k, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_int4.linear(library, x, packed, n, 128, bias)
        torch.set_num_threads(2)
        two = cpu_int4.linear(library, x, packed, n, 128, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bfloat16_output_is_the_float32_one_rounded_to_nearest_even(library):
    """x bfloat16 widens exactly, so the sums are those of x.float(); the output is their
    rounding (torch's .to(bfloat16): nearest-even), with or without a bias."""
    for rows, n, k in ((1, 65, 384), (2, 129, 64), (9, 33, 128)):
        for bias in (False, True):
            _, _, _, packed, b = int4_layer(n, k, 32, bias=bias)
            x = randn(rows, k, dtype=torch.bfloat16)
            wide = cpu_int4.linear(library, x.float(), packed, n, 32, b)
            assert torch.equal(cpu_int4.linear(library, x, packed, n, 32, b), wide.bfloat16())


def test_blocks_at_the_edges_of_the_fixed_point(library):
    """A block's largest |x| just under a power of two (its 24-bit X would pass the three
    digits' range: one bit fewer), at a power of two, tiny (2^-120) and zero."""
    q, scale, offset, packed, bias = int4_layer(65, 128, 32)
    x = randn(6, 128)
    x[0, :32] = (1 - 2.0**-24) * torch.sign(x[0, :32])  # every value at the block's largest
    x[1, 32:64] = -(2.0**5)
    x[2, :] *= 2.0**-120
    x[3, 64:96] = 0
    x[4, 96:] = (0.9999 * 2.0**10) * torch.sign(x[4, 96:])
    x[5, :] = 1e30 * torch.sign(x[5, :])  # large but finite sums
    y = cpu_int4.linear(library, x, packed, 65, 32, bias)
    assert_close_to_exact(library, y, x, q, scale, offset, 32, bias)


def test_rows_holding_inf_or_nan_give_what_float_arithmetic_gives(library):
    """Such a row is summed in float32 from the dequantized weights: where y is inf or NaN is
    where F.linear's is (an inf meets weights of both signs: NaN); the other rows are the
    kernel's."""
    q, scale, offset, packed, bias = int4_layer(65, 128, 32)
    x = randn(4, 128)
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    y = cpu_int4.linear(library, x, packed, 65, 32, bias)
    reference = torch.nn.functional.linear(x, cpu_int4.dequantize(q, scale, offset, 32), bias)
    assert torch.equal(y.isnan(), reference.isnan()) and torch.equal(y.isinf(), reference.isinf())
    assert y[1:3].isnan().any() and y[0].isfinite().all() and y[3].isfinite().all()
    finite = [0, 3]
    assert_close_to_exact(library, y[finite], x[finite], q, scale, offset, 32, bias)


def test_x_is_taken_in_any_layout_and_leading_shape(library):
    q, scale, offset, packed, bias = int4_layer(65, 64, 32)
    base = randn(64, 14)
    for x in (base.T, randn(9, 128)[:, ::2], randn(2, 3, 64)):
        assert not x.is_contiguous() or x.dim() == 3
        y = cpu_int4.linear(library, x, packed, 65, 32, bias)
        assert y.shape == (*x.shape[:-1], 65)
        flat = x.reshape(-1, 64)
        assert_close_to_exact(library, y.reshape(-1, 65), flat, q, scale, offset, 32, bias)


def test_no_rows_and_no_inputs(library):
    _, _, _, packed, bias = int4_layer(17, 32, 32)
    assert cpu_int4.linear(library, torch.zeros(0, 32), packed, 17, 32, bias).shape == (0, 17)
    q, scale, offset = cpu_int4.quantize(torch.zeros(17, 0), 32)
    empty = cpu_int4.pack(q, scale, offset, 32)
    y = cpu_int4.linear(library, torch.zeros(3, 0), empty, 17, 32, bias)
    assert torch.equal(y, bias.expand(3, 17))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("group_size", (32, 128))
def test_quantize_rounds_each_weight_to_the_nearest_step_of_its_groups_range(dtype, group_size):
    """|w - (scale q + offset)| <= scale (1/2 + 2^-20); offset = the group's least weight
    (q = 0), scale = its range / 15 (its greatest at q = 15); a constant group: scale 0, exact."""
    weight = randn(300, 512, dtype=dtype) * torch.logspace(-6, 6, 300)[:, None].to(dtype)
    weight[7, :group_size] = 0.5
    q, scale, offset = cpu_int4.quantize(weight, group_size)
    assert q.dtype == torch.uint8 and scale.dtype == offset.dtype == torch.float32
    assert q.shape == weight.shape and scale.shape == offset.shape == (300, 512 // group_size)
    assert int(q.max()) <= 15
    s, o = per_channel(scale, group_size), per_channel(offset, group_size)
    error = (weight.double() - (s * q.double() + o)).abs()
    assert (error <= s * (0.5 + 2.0**-20)).all()
    groups = weight.float().view(300, -1, group_size)
    assert torch.equal(offset, groups.amin(dim=2))
    assert torch.equal(scale, ((groups.amax(dim=2).double() - offset.double()) / 15).float())
    qg = q.view(300, -1, group_size)
    varied = scale > 0
    assert (qg.amin(dim=2)[varied] == 0).all() and (qg.amax(dim=2)[varied] == 15).all()
    assert scale[7, 0] == 0 and offset[7, 0] == 0.5 and not q[7, :group_size].any()


def test_min_max_groups_err_less_than_a_symmetric_grid():
    """Why quantize() spans each group's own range: on Gaussian weights its RMS error is below
    that of the symmetric grid scale = max |w| / 7, q - 8 in -7..7 (15 of the 16 levels)."""
    weight = randn(512, 1024)
    q, scale, offset = cpu_int4.quantize(weight, 128)
    ours = cpu_int4.dequantize(q, scale, offset, 128) - weight
    groups = weight.view(512, 8, 128)
    step = groups.abs().amax(dim=2, keepdim=True) / 7
    symmetric = (torch.round(groups / step).clamp(-7, 7) * step).view(512, 1024) - weight
    assert ours.pow(2).mean() < 0.9 * symmetric.pow(2).mean()


def test_dequantize_is_scale_times_q_plus_offset_in_float32():
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    scale, offset = randn(3, 2), randn(3, 2, seed=1)
    w = cpu_int4.dequantize(q, scale, offset, 32)
    expected = q.float().view(3, 2, 32) * scale[..., None] + offset[..., None]
    assert w.dtype == torch.float32 and torch.equal(w, expected.view(3, 64))
    assert w[1, 40] == q[1, 40].float() * scale[1, 1] + offset[1, 1]


def test_pack_lays_out_groups_of_scales_offsets_and_lines_and_unpack_undoes_it():
    q = torch.randint(0, 16, (130, 64), dtype=torch.uint8)
    scale, offset = randn(130, 2), randn(130, 2, seed=1)
    packed = cpu_int4.pack(q, scale, offset, 32)
    assert packed.shape == (3, 2, 512 + 4 * 256) and packed.dtype == torch.uint8
    # panel 1, group 1: channel 70 is the panel's 6th; k = 32 + 8 * 2 + 5 is line 2, byte 1's
    # high nibble (k + 4)
    group = packed[1, 1]
    assert torch.equal(group[:256].view(torch.float32), scale[64:128, 1])
    assert torch.equal(group[256:512].view(torch.float32), offset[64:128, 1])
    byte = int(group[512 + 2 * 256 + 4 * 6 + 1])
    assert byte & 0xF == q[70, 32 + 16 + 1] and byte >> 4 == q[70, 32 + 16 + 5]
    padded = cpu_int4.unpack(packed, 192, 32)  # panel 2 holds channels 128 and 129 only
    assert not any(t[130:].any() for t in padded)
    unpacked = cpu_int4.unpack(packed, 130, 32)
    assert all(torch.equal(a, b) for a, b in zip(unpacked, (q, scale, offset)))


def test_wrong_arguments_are_errors_naming_them(library):
    q, scale, offset, packed, _ = int4_layer(65, 64, 32, bias=False)
    x = randn(2, 64)
    with pytest.raises(TypeError, match="x must be"):
        cpu_int4.linear(library, x.double(), packed, 65, 32)
    with pytest.raises(ValueError, match="in_features 64"):
        cpu_int4.linear(library, randn(2, 65), packed, 65, 32)
    with pytest.raises(ValueError, match="does not hold 200 rows"):
        cpu_int4.linear(library, x, packed, 200, 32)
    with pytest.raises(ValueError, match="groups of 64"):
        cpu_int4.linear(library, x, packed, 65, 64)
    with pytest.raises(ValueError, match="bias must be"):
        cpu_int4.linear(library, x, packed, 65, 32, torch.zeros(64))
    with pytest.raises(TypeError, match="packed must be"):
        cpu_int4.linear(library, x, packed.float(), 65, 32)
    with pytest.raises(ValueError, match="q must hold values 0..15"):
        cpu_int4.pack(q + 16, scale, offset, 32)
    with pytest.raises(TypeError, match="q must be a uint8"):
        cpu_int4.pack(q.to(torch.int8), scale, offset, 32)
    with pytest.raises(ValueError, match=r"scale must be \[65, 2\]"):
        cpu_int4.pack(q, scale[:, :1], offset, 32)
    with pytest.raises(TypeError, match="offset must be a float32"):
        cpu_int4.pack(q, scale, offset.double(), 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_int4.quantize(randn(4, 48), 48)
    with pytest.raises(ValueError, match="not a multiple of group_size 128"):
        cpu_int4.quantize(randn(4, 64), 128)
    with pytest.raises(ValueError, match="weight must be"):
        cpu_int4.quantize(torch.zeros(3), 32)


# -- GGUF's forms: SYMMETRIC (Q4_0) and SUB_SCALED (Q4_K) -------------------------------------
#
# Their weights, w = scale (q - 8) and w = scale sc q + offset m, from float16 scales and 6-bit
# sc and m (as a file's): the reference is x times those weights in float64, where they are
# exact (their float32 rounding is the file's dequantized value: tests/test_gguf.py). The bound
# is the one above, the roundings counted per form (cpu_int4.cpp): SYMMETRIC rounds its exact
# int32 sum once and adds it to the total once a sub-block of 32 inputs; SUB_SCALED adds its two
# terms to the total once an x block and rounds within a block 5 times (the sums' conversions)
# and once a sub-block (its sum(X), its offsets' sum). Without FMA every addition to a total or
# a sum is two.

Form = cpu_int4.Form
FORMS = (
    (Form.SYMMETRIC, 32),
    (Form.SYMMETRIC, 128),
    (Form.SUB_SCALED, 256),
    (Form.SUB_SCALED, 64),
    (Form.SUB_SCALED, 2048),
)
FORM_SHAPES = ((1, 2048), (17, 2048), (64, 2048), (65, 4096), (129, 2048))  # (N, K)


@functools.cache
def form_layer(n: int, k: int, form: Form, group_size: int, seed: int = 1, bias: bool = True):
    """(canonical tensors, packed, bias) of a random [n, k] weight in `form`: float16 scales
    and offsets (each row at another scale), sc and m in 0..63, q in 0..15."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.logspace(-4, 0, n)[:, None]
    groups = (n, k // group_size)
    scale = (torch.rand(groups, generator=g) * magnitude).half().float()
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    if form == Form.SYMMETRIC:
        canonical = (q, scale, -8 * scale)
    else:
        offset = -(torch.rand(groups, generator=g) * magnitude).half().float()
        sc, m = (torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8) for _ in "sm")
        canonical = (q, scale, offset, sc, m)
    packed = cpu_int4.pack(*canonical[:3], group_size, form, *canonical[3:])
    return canonical, packed, randn(n, seed=seed + 1) if bias else None


def form_parts(canonical, group_size) -> tuple[torch.Tensor, torch.Tensor]:
    """Each weight's scale and offset [N, K] float64: w = scale q + offset exactly."""
    q, scale, offset, *subs = canonical
    s, o = per_channel(scale, group_size), per_channel(offset, group_size)
    if subs:
        s, o = s * per_channel(subs[0], 32), o * per_channel(subs[1], 32)
    return s, o


def assert_form_close_to_exact(library, form, y, x, canonical, group_size, bias) -> None:
    q = canonical[0]
    s, o = form_parts(canonical, group_size)
    weight = s * q.double() + o  # exact in float64 (each product too: 21 and 17 bits)
    exact = x.double() @ weight.T + (0 if bias is None else bias.double())
    k = x.shape[1]
    block = library.nanovllm_int4_x_block(group_size)
    amax = x.abs().double().view(-1, k // block, block).amax(dim=2)
    amax = amax.repeat_interleave(block, dim=1).clamp(min=2.0**-100)
    magnitude = (x.abs().double() + 2.0**-14 * amax) @ (s.abs() * q.double() + o.abs()).T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    fused = 1 if library.nanovllm_int4_vector_width() > 4 else 2
    if form == Form.SYMMETRIC:
        roundings = fused * k // 32 + 6
    else:
        roundings = 2 * fused * (k // block) + fused * k // 32 + 12
    bound = 2.0**-23 / 0.996 * (amax @ weight.abs().T) + roundings * U * magnitude
    case = f"{form.name} {tuple(x.shape)} x {tuple(q.shape)} (groups of {group_size})"
    assert_within(y, exact, bound, case)


def check_forms(library, dtype, rows) -> None:
    for i, (n, k) in enumerate(FORM_SHAPES):
        for j, (form, group_size) in enumerate(FORMS):
            canonical, packed, bias = form_layer(n, k, form, group_size, i + j, (i + j) % 2 == 0)
            x = randn(rows, k, seed=rows) * torch.logspace(-3, 3, k)[torch.randperm(k)]
            x = x.to(dtype)
            y = cpu_int4.linear(library, x, packed, n, group_size, bias, form)
            assert y.dtype == dtype and y.shape == (rows, n)
            assert_form_close_to_exact(library, form, y, x, canonical, group_size, bias)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows", (1, 2, 3, 4, 5, 8, 9, 17, 130))
def test_gguf_forms_are_the_product_with_their_exact_weights(library, dtype, rows):
    check_forms(library, dtype, rows)


@pytest.mark.parametrize(
    "flag,width", [("-mno-avx512vnni", 16), ("-mno-avx512f", 8), ("-mno-avx", 4)]
)
@pytest.mark.skipif(not X86, reason="x86 flags")
def test_gguf_forms_in_the_vnni_free_avx2_and_generic_builds(library, flag, width):
    other = other_build(library, flag, width)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 2, 3, 9):
            check_forms(other, dtype, rows)


@pytest.mark.parametrize("form,group_size", FORMS)
def test_gguf_forms_rows_do_not_depend_on_the_other_rows(library, form, group_size):
    """1- and 2-row tiles, SUB_SCALED's shorter tall ones and a last, shorter tile."""
    _, packed, bias = form_layer(129, 2048, form, group_size)
    x = randn(11, 2048)
    together = cpu_int4.linear(library, x, packed, 129, group_size, bias, form)
    for m in range(11):
        alone = cpu_int4.linear(library, x[m : m + 1], packed, 129, group_size, bias, form)
        assert torch.equal(alone[0], together[m]), m
    pair = cpu_int4.linear(library, x[3:5], packed, 129, group_size, bias, form)
    assert torch.equal(pair, together[3:5])


@pytest.mark.parametrize("form,group_size", FORMS[:3])
def test_gguf_forms_rows_holding_inf_or_nan_give_what_float_arithmetic_gives(
    library, form, group_size
):
    canonical, packed, bias = form_layer(65, 2048, form, group_size)
    x = randn(3, 2048)
    x[1, 5], x[2, 700] = float("inf"), float("nan")
    y = cpu_int4.linear(library, x, packed, 65, group_size, bias, form)
    q, scale, offset, *subs = canonical
    weight = cpu_int4.dequantize(q, scale, offset, group_size, *subs)
    reference = torch.nn.functional.linear(x, weight, bias)
    assert torch.equal(y.isnan(), reference.isnan()) and torch.equal(y.isinf(), reference.isinf())
    assert y[1:].isnan().any() and y[0].isfinite().all()


def test_the_forms_store_fewer_bytes_a_weight():
    """Q4_0's 0.5625 bytes a weight (its file's), Q4_K's 0.59375 (its file's 0.5625, with sc
    and m a byte each), against 0.75 for AFFINE groups of 32 (0.5625 at 128)."""
    expected = {
        (Form.AFFINE, 32): 0.75,
        (Form.AFFINE, 128): 0.5625,
        (Form.SYMMETRIC, 32): 0.5625,
        (Form.SUB_SCALED, 256): 0.59375,
    }
    for (form, group_size), per_weight in expected.items():
        assert cpu_int4.bytes_per_weight(group_size, form) == per_weight
        if form == Form.AFFINE:
            _, _, _, packed, _ = int4_layer(128, 512, group_size)
        else:
            _, packed, _ = form_layer(128, 512, form, group_size)
        assert packed.numel() == per_weight * 128 * 512


@pytest.mark.parametrize("form,group_size", FORMS)
def test_gguf_forms_pack_and_unpack_round_trip(form, group_size):
    canonical, packed, _ = form_layer(130, 2048, form, group_size)
    header = cpu_int4.header_bytes(group_size, form)
    assert packed.shape == (3, 2048 // group_size, header + group_size // 8 * 256)
    unpacked = cpu_int4.unpack(packed, 130, group_size, form)
    assert len(unpacked) == len(canonical)
    assert all(torch.equal(a, b) for a, b in zip(unpacked, canonical))
    q, scale, offset, *subs = canonical
    weight = cpu_int4.dequantize(q, scale, offset, group_size, *subs)
    s, o = form_parts(canonical, group_size)
    assert torch.equal(weight, (s * q.double() + o).float())  # exact products, one rounding


def test_gguf_forms_refuse_what_they_cannot_hold_exactly(library):
    (q, scale, offset), _, _ = form_layer(65, 256, Form.SYMMETRIC, 32)
    with pytest.raises(ValueError, match="offset must be -8 scale"):
        cpu_int4.pack(q, scale, offset + 1, 32, Form.SYMMETRIC)
    with pytest.raises(ValueError, match="float16 values"):
        cpu_int4.pack(q, scale * (1 + 2.0**-20), offset * (1 + 2.0**-20), 32, Form.SYMMETRIC)
    (q, scale, offset, sc, m), packed, _ = form_layer(65, 256, Form.SUB_SCALED, 256)
    with pytest.raises(ValueError, match="sub_offset must hold values 0..63"):
        cpu_int4.pack(q, scale, offset, 256, Form.SUB_SCALED, sc, m | 64)
    with pytest.raises(TypeError, match="sub_scale must be a uint8"):
        cpu_int4.pack(q, scale, offset, 256, Form.SUB_SCALED, None, m)
    with pytest.raises(ValueError, match="SUB_SCALED's"):
        cpu_int4.pack(q, scale, offset, 256, Form.AFFINE, sc, m)
    with pytest.raises(ValueError, match="groups of 256 in the AFFINE form"):
        cpu_int4.linear(library, randn(1, 256), packed, 65, 256)
