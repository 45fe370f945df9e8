"""The CPU's int8 weight-only linear (nanovllm/kernels/cpu_int8.py) against a float64 product of
x and the dequantized weight. On the FMA and AMX paths its error is float32 accumulation's only:
each product x * q is exact in float32 (q has 8 bits, x widened from bfloat16 8 more), so over K
terms, then the scale and the bias (one rounding each), |y - exact| <= (K + 2) u (sum_k |x_k|
|w_k| + |bias|) with u = 2^-24 (the recursive-summation bound); a bfloat16 output adds its
rounding, half an ulp: at most 2^-8 |y| (8 significant bits). Every call is held to that bound.

The VNNI path (AVX-512 VNNI, from 16 inputs on) is held to its own, tighter at large K
(cpu_int8.cpp's VNNI section): x is rounded per block of B = 256 inputs to 23 bits below the
block's largest |x|, at most 2^-23 max_b |x| / 0.996 an element (max_b |x| taken as 2^-100 at
least); the integer products and sums are exact; each block adds two roundings to its d and one
to the row's total, the end one, each at most u of a partial sum no larger than

    A = sum_k |w_k| (|x_k| + 2^-14 max_b |x|) + |bias|

(the 2^-14 covers the rounded x and its digits). So

    |y - exact| <= 2^-23 / 0.996 sum_k |w_k| max_b |x| + (3 blocks + 2) u A.

Shapes on and around the kernel's limits: 64-channel panels, vectors of 16 (AVX-512) or 8
(AVX2), tiles of 6 and 14 rows (AVX-512) or 1 and 6 (AVX2), of 1 and 2 rows (VNNI), x blocks of
256 and K not a multiple of 4. The AVX-512 FMA tiles (built without VNNI and AMX), the AVX2 and
the generic builds are tested here too where the CPU runs them (x86: built with
-mno-avx512vnni -mno-amx-tile, -mno-avx512f, -mno-avx)."""

import functools
import platform

import pytest
import torch
from conftest import native_library

from nanovllm.kernels import cpu_int8

U = 2.0**-24
CHANNELS = (1, 15, 16, 17, 31, 33, 63, 64, 65, 129)  # N
INPUTS = (1, 15, 16, 17, 64, 65, 300)  # K
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 13, 14, 15, 17, 29, 64, 257)  # M
X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture
def library():
    return native_library(cpu_int8.load)


def randn(*shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@functools.cache
def int8_layer(n: int, k: int, seed: int = 1, bias: bool = True):
    """(qweight, scale, packed, bias) of a random [n, k] weight (made once: tests only read it)."""
    qweight, scale = cpu_int8.quantize(randn(n, k, seed=seed))
    return qweight, scale, cpu_int8.pack(qweight), randn(n, seed=seed + 1) if bias else None


def assert_close_to_exact(library, y, x, qweight, scale, bias) -> None:
    """y within float32 accumulation's bound of the float64 product (see the module's doc)."""
    k = qweight.shape[1]
    weight = cpu_int8.dequantize(qweight, scale).double()
    exact = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    bound = (k + 2) * U * magnitude
    if x.dtype == torch.float32 and 0 < library.nanovllm_int8_amx_rows(0) <= len(x):
        bound = (3 * k + 2) * U * (1 + 2**-6) * magnitude  # x in three parts (AMX)
    assert_within(y, exact, bound, x, qweight)


def assert_within(y, exact, bound, x, qweight) -> None:
    """|y - exact| within `bound` everywhere (a bfloat16 y: and its own rounding)."""
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * (exact.abs() + bound)
    error = (y.double() - exact).abs()
    worst = (error - bound).argmax()
    assert (error <= bound).all(), (
        f"{tuple(x.shape)} x {tuple(qweight.shape)}: error {error.flatten()[worst]:.3g} over "
        f"the bound {bound.flatten()[worst]:.3g} at {divmod(int(worst), qweight.shape[0])}"
    )


def check_shapes(library, dtype, rows) -> None:
    """Every (N, K) of the grid at `rows` rows, with a bias on every other one."""
    for i, n in enumerate(CHANNELS):
        for j, k in enumerate(INPUTS):
            qweight, scale, packed, bias = int8_layer(n, k, seed=i + j, bias=(i + j) % 2 == 0)
            x = randn(rows, k, seed=rows, dtype=dtype)
            y = cpu_int8.linear(library, x, packed, scale, n, bias)
            assert y.dtype == dtype and y.shape == (rows, n)
            assert_close_to_exact(library, y, x, qweight, scale, bias)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows", ROWS)
def test_linear_is_the_product_with_the_dequantized_weight(library, dtype, rows):
    check_shapes(library, dtype, rows)


@pytest.mark.parametrize(
    "flags,width",
    [(("-mno-avx512vnni", "-mno-amx-tile"), 16), (("-mno-avx512f",), 8), (("-mno-avx",), 4)],
)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.skipif(not X86, reason="x86 flags")
def test_the_fma_avx2_and_generic_builds_are_the_product_too(library, flags, width, dtype):
    """Built for this CPU without VNNI and AMX (the AVX-512 FMA tiles at every row count),
    without AVX-512 (AVX2) or without AVX (generic vectors): the paths of other CPUs."""
    if library.nanovllm_int8_vector_width() < width:
        pytest.skip(f"this CPU's own build already has {width}-float vectors or fewer")
    own = library.nanovllm_int8_amx_rows(0) + library.nanovllm_int8_vnni_inputs()
    if width == 16 and own == 0:
        pytest.skip("this CPU's own build already runs without VNNI and AMX")
    other = native_library(lambda: cpu_int8.load(flags))
    assert other.nanovllm_int8_vector_width() == width and other.nanovllm_int8_amx_rows(0) == 0
    assert other.nanovllm_int8_vnni_inputs() == 0
    for rows in (1, 5, 6, 7, 12, 13, 14, 15, 64, 257):
        check_shapes(other, dtype, rows)
    for rows in (13, 43):
        check_chunks(other, dtype, rows)


def test_bfloat16_output_is_the_float32_one_rounded_to_nearest_even(library):
    """x bfloat16 widens exactly, so the sums are those of x.float(); the output is their
    rounding (torch's .to(bfloat16): nearest-even), with or without a bias."""
    for rows, n, k in ((1, 65, 300), (7, 129, 64), (64, 33, 17)):
        for bias in (False, True):
            _, scale, packed, b = int8_layer(n, k, bias=bias)
            x = randn(rows, k, dtype=torch.bfloat16)
            wide = cpu_int8.linear(library, x.float(), packed, scale, n, b)
            assert torch.equal(cpu_int8.linear(library, x, packed, scale, n, b), wide.bfloat16())


def test_bfloat16_output_ties_go_to_even(library):
    """Sums exactly halfway between two bfloat16 numbers (1 + 2^-8 between 1 and 1 + 2^-7):
    to the even one, in the vector stores (channels 0-15) and the last, lone channel."""
    # Two bfloat16 numbers a row; their sums are ties (the nearest even: 1, 1 + 2^-6, 2, -1,
    # 3 + 2^-5).
    x = torch.tensor(
        [[1, 2**-8], [1 + 2**-7, 2**-8], [2, 2**-7], [-1, -(2**-8)], [3 + 2**-6, 2**-7]]
    )
    ties = x.sum(dim=1)
    assert torch.equal(x, x.bfloat16().float())
    qweight = torch.ones(17, 2, dtype=torch.int8)
    y = cpu_int8.linear(library, x.bfloat16(), cpu_int8.pack(qweight), torch.ones(17), 17)
    assert torch.equal(y, ties.bfloat16()[:, None].expand(5, 17))
    assert not torch.equal(y[:, 0].float(), ties)  # they were ties, rounded


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize(
    "rows,n,k", [(1, 1000, 300), (3, 700, 400), (64, 257, 300), (400, 100, 3000)]
)
def test_one_and_two_threads_give_the_same_bits(library, dtype, rows, n, k):
    """Large enough to be spread over the threads; each output is one thread's sum in the
    same order either way."""
    _, scale, packed, bias = int8_layer(n, k)
    x = randn(rows, k, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_int8.linear(library, x, packed, scale, n, bias)
        torch.set_num_threads(2)
        two = cpu_int8.linear(library, x, packed, scale, n, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def check_chunks(library, dtype, rows) -> None:
    """K = 3000: a chunk of rows (whose packed x stays in L2) is one tile, 14 rows (AVX-512) or
    6 (AVX2); with AMX 3 blocks of 16 rows (float32 x) or 10 (bfloat16)."""
    qweight, scale, packed, bias = int8_layer(100, 3000)
    x = randn(rows, 3000, dtype=dtype)
    y = cpu_int8.linear(library, x, packed, scale, 100, bias)
    assert_close_to_exact(library, y, x, qweight, scale, bias)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows", (13, 29, 43, 160, 400))
def test_rows_in_several_chunks(library, dtype, rows):
    """Several chunks, packed into two buffers by turns, the last one short."""
    check_chunks(library, dtype, rows)


def test_x_is_taken_in_any_layout_and_leading_shape(library):
    qweight, scale, packed, bias = int8_layer(65, 40)
    base = randn(40, 14)
    for x in (base.T, randn(9, 80)[:, ::2], randn(2, 3, 40)):
        assert not x.is_contiguous() or x.dim() == 3
        y = cpu_int8.linear(library, x, packed, scale, 65, bias)
        assert y.shape == (*x.shape[:-1], 65)
        assert_close_to_exact(library, y.reshape(-1, 65), x.reshape(-1, 40), qweight, scale, bias)


def test_no_rows_and_no_inputs(library):
    _, scale, packed, bias = int8_layer(17, 5)
    assert cpu_int8.linear(library, torch.zeros(0, 5), packed, scale, 17, bias).shape == (0, 17)
    qweight, scale = cpu_int8.quantize(torch.zeros(17, 0))
    y = cpu_int8.linear(library, torch.zeros(3, 0), cpu_int8.pack(qweight), scale, 17, bias)
    assert torch.equal(y, bias.expand(3, 17))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_quantize_rounds_each_weight_to_the_nearest_step(dtype):
    """|w - q * scale| <= scale (1/2 + 2^-17) (the division's rounding: half an ulp of a value
    <= 127), scale = max |w_row| / 127, a row's largest weight at +-127, zero rows 0."""
    weight = randn(300, 257, dtype=dtype) * torch.logspace(-6, 6, 300)[:, None].to(dtype)
    weight[7] = 0
    qweight, scale = cpu_int8.quantize(weight)
    assert qweight.dtype == torch.int8 and scale.dtype == torch.float32
    assert qweight.shape == weight.shape and scale.shape == (300,)
    w = weight.double()
    error = (w - qweight.double() * scale.double()[:, None]).abs()
    assert (error <= scale.double()[:, None] * (0.5 + 2.0**-17)).all()
    amax = w.abs().amax(dim=1)
    nonzero = amax > 0
    assert torch.equal(scale[nonzero], (weight.float().abs().amax(dim=1) / 127)[nonzero])
    assert (qweight[nonzero].abs().amax(dim=1) == 127).all()
    assert (qweight[7] == 0).all() and scale[7] > 0
    assert torch.equal(cpu_int8.dequantize(qweight, scale), qweight.float() * scale[:, None])


def test_pack_lays_out_panels_of_64_channels_padded_with_zeros():
    qweight = torch.randint(-127, 128, (130, 7), dtype=torch.int8)
    packed = cpu_int8.pack(qweight)
    assert packed.shape == (3, 7, 64) and packed.dtype == torch.int8
    channels = packed.transpose(1, 2).reshape(192, 7)  # [panel * 64 + j, k]
    assert torch.equal(channels[:130], qweight) and not channels[130:].any()


def test_wrong_arguments_are_errors_naming_them(library):
    _, scale, packed, _ = int8_layer(65, 40, bias=False)
    x = randn(2, 40)
    with pytest.raises(TypeError, match="x must be"):
        cpu_int8.linear(library, x.double(), packed, scale, 65)
    with pytest.raises(ValueError, match="in_features 40"):
        cpu_int8.linear(library, randn(2, 41), packed, scale, 65)
    with pytest.raises(ValueError, match="does not hold 200 rows"):
        cpu_int8.linear(library, x, packed, scale, 200)
    with pytest.raises(ValueError, match="scale must be"):
        cpu_int8.linear(library, x, packed, scale[:64], 65)
    with pytest.raises(ValueError, match="bias must be"):
        cpu_int8.linear(library, x, packed, scale, 65, torch.zeros(64))
    with pytest.raises(TypeError, match="packed must be"):
        cpu_int8.linear(library, x, packed.float(), scale, 65)
    with pytest.raises(TypeError, match="qweight must be"):
        cpu_int8.pack(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="weight must be"):
        cpu_int8.quantize(torch.zeros(3))


# ---- the VNNI path: x in fixed point ----------------------------------------------------------

VNNI_INPUTS = (16, 17, 255, 256, 257, 300, 1027)  # K: one block, blocks of 256, K % 4 != 0
VNNI_CHANNELS = (1, 17, 64, 65, 129)  # N
VNNI_ROWS = (1, 2, 3, 4, 5, 8, 13)  # M: tiles of 2 rows and a last one of 1


@pytest.fixture
def vnni_library(library):
    """A build whose VNNI path takes every row count: this CPU's own, or, where it has AMX (which
    takes from 6 or 12 rows on), the same without AMX."""
    if library.nanovllm_int8_vnni_inputs() == 0:
        pytest.skip("this CPU's build has no VNNI path (AVX-512 VNNI)")
    if library.nanovllm_int8_amx_rows(0) == 0:
        return library
    return native_library(lambda: cpu_int8.load(("-mno-amx-tile",)))


def vnni_bound(library, x, qweight, scale, bias) -> torch.Tensor:
    """The bound of the module's doc for the VNNI path, every output [M, N] (before a bfloat16
    rounding)."""
    x = x.double()
    rows, k = x.shape
    block = library.nanovllm_int8_x_block()
    blocks = -(-k // block)
    padded = torch.nn.functional.pad(x.abs(), (0, blocks * block - k))
    amax = padded.view(rows, blocks, block).amax(dim=2).repeat_interleave(block, dim=1)[:, :k]
    amax = amax.clamp(min=2.0**-100)  # the smallest step's blocks
    weight = cpu_int8.dequantize(qweight, scale).double().abs()  # [N, K]
    magnitude = (x.abs() + 2.0**-14 * amax) @ weight.T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return 2.0**-23 / 0.996 * (amax @ weight.T) + (3 * blocks + 2) * U * magnitude


def assert_within_vnni_bound(library, y, x, qweight, scale, bias) -> None:
    weight = cpu_int8.dequantize(qweight, scale).double()
    exact = x.double() @ weight.T + (0 if bias is None else bias.double())
    bound = vnni_bound(library, x, qweight, scale, bias)
    assert_within(y, exact, bound, x, qweight)


def rows_at_many_scales(rows: int, k: int, seed: int, dtype) -> torch.Tensor:
    """Random rows, each at its own scale (1e-30 .. 1e6), some inputs 1e3 times their row's
    others (an outlier in a block), a block of zeros and one of denormals where K allows."""
    x = randn(rows, k, seed=seed) * torch.logspace(-30, 6, rows)[:, None]
    x[:, ::37] *= 1e3
    if k > 512:
        x[0, 256:512] = 0
        x[-1, 512:768] = randn(256, seed=seed + 1) * 1e-40  # float32 denormals
    return x.to(dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows", VNNI_ROWS)
def test_vnni_path_is_within_its_fixed_point_bound(vnni_library, dtype, rows):
    for i, n in enumerate(VNNI_CHANNELS):
        for j, k in enumerate(VNNI_INPUTS):
            qweight, scale, packed, bias = int8_layer(n, k, seed=i + j, bias=(i + j) % 2 == 0)
            for x in (
                randn(rows, k, seed=rows, dtype=dtype),
                rows_at_many_scales(rows, k, j, dtype),
            ):
                y = cpu_int8.linear(vnni_library, x, packed, scale, n, bias)
                assert y.dtype == dtype and y.shape == (rows, n)
                assert_within_vnni_bound(vnni_library, y, x, qweight, scale, bias)


def test_vnni_path_weights_at_the_int8_limits(vnni_library):
    """Every weight at -128 (which quantize() never makes), 127 or 0, against x at its fixed
    point's limits (a block's largest |x| just under a power of two, where X would not fit three
    digits, and signs alternating): the sums' bounds of cpu_int8.cpp's VNNI section."""
    k = 300
    qweight = torch.full((70, k), 127, dtype=torch.int8)
    qweight[::3] = -128
    qweight[1::7] = 0
    scale = torch.rand(70, generator=torch.Generator().manual_seed(0)) + 0.5
    packed = cpu_int8.pack(qweight)
    top = torch.tensor(1 - 2.0**-24)  # 0.99999994: X = 2^23 would overflow, one bit fewer
    signs = torch.tensor([1.0, -1.0]).repeat(k // 2)
    for x in (top * signs, -top * torch.ones(k), top * torch.ones(k), randn(k) * 2.0**100):
        x = x.expand(3, k).contiguous()
        y = cpu_int8.linear(vnni_library, x, packed, scale, 70)
        assert_within_vnni_bound(vnni_library, y, x, qweight, scale, None)


def test_vnni_path_row_results_do_not_depend_on_the_other_rows(vnni_library):
    """A row's fixed point is its own: alone, or in a tile of two, in any batch, the same bits."""
    _, scale, packed, bias = int8_layer(129, 1027)
    x = randn(7, 1027) * torch.logspace(-3, 3, 7)[:, None]
    together = cpu_int8.linear(vnni_library, x, packed, scale, 129, bias)
    for m in range(7):
        alone = cpu_int8.linear(vnni_library, x[m : m + 1], packed, scale, 129, bias)
        assert torch.equal(alone[0], together[m])


def test_non_finite_x_gives_the_infs_and_nans_of_the_float_product(library):
    """Rows holding an inf or a NaN (the fixed point has neither: the VNNI path runs them through
    the float32 tile) give the infs and NaNs of x @ w^T; the finite rows beside them are as
    they are alone."""
    qweight, scale, packed, bias = int8_layer(65, 300)
    qweight_zero = qweight.clone()
    qweight_zero[5, 7] = 0  # inf * 0: a NaN in channel 5 only
    packed = cpu_int8.pack(qweight_zero)
    x = randn(5, 300)
    x[1, 7] = float("inf")
    x[2, 9] = float("nan")
    x[3, 7], x[3, 8] = float("inf"), float("-inf")
    for dtype in (torch.float32, torch.bfloat16):
        y = cpu_int8.linear(library, x.to(dtype), packed, scale, 65, bias).double()
        exact = x.to(dtype).double() @ cpu_int8.dequantize(qweight_zero, scale).double().T
        exact = exact + bias.double()
        assert torch.equal(y.isnan(), exact.isnan()) and torch.equal(y.isinf(), exact.isinf())
        finite = exact.isfinite()
        assert torch.equal(y[finite].sign(), exact[finite].sign())
        for m in (0, 4):
            alone = cpu_int8.linear(library, x[m : m + 1].to(dtype), packed, scale, 65, bias)
            assert torch.equal(alone[0].double(), y[m])
