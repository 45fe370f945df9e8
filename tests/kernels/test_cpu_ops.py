"""The CPU's native RMSNorm, residual add + RMSNorm and rotary (nanovllm/kernels/cpu_ops.py)
against the eager ops of layers/ they stand in for, bit for bit (torch.equal) in float32 and
bfloat16: every step rounds where PyTorch's does and the mean's sum runs in the order of
PyTorch's CPU sum (its vector width taken from torch's CPU capability, as on x86). Shapes
off the vector width (hidden 40, 1 and 3 rows), q and k as views of the qkv projection,
GQA, positions at the end of the cache; and, where the C++ does not apply, the eager op."""

import pytest
import torch
from conftest import native_library

from nanovllm.kernels import cpu_ops
from nanovllm.layers.layernorm import add_rms_norm, rms_norm
from nanovllm.layers.rotary_embedding import apply_rotary_emb, get_rope
from nanovllm.platforms.cpu.ops import NATIVE


@pytest.fixture
def cpu_ops_library():
    return native_library(cpu_ops.load)


built = pytest.mark.usefixtures("cpu_ops_library")  # skipped only where no compiler exists
DTYPES = (torch.float32, torch.bfloat16)
MAX_POSITION = 4096


def qkv_cases(test):
    """Built, over both dtypes, 1, 3 and 256 rows and four head layouts (GQA, MHA, head_dim 40)."""
    test = pytest.mark.parametrize(
        "heads,kv_heads,head_dim", [(2, 1, 16), (4, 2, 64), (16, 8, 128), (3, 3, 40)]
    )(test)
    test = pytest.mark.parametrize("rows", [1, 3, 256])(test)
    return built(pytest.mark.parametrize("dtype", DTYPES)(test))


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def qk_views(rows: int, heads: int, kv_heads: int, head_dim: int, dtype):
    """q [rows, heads, head_dim] and k [rows, kv_heads, head_dim] as the decoder makes them:
    views of one qkv row each (not contiguous)."""
    qkv = randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=1)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)


class Spy:
    """An eager op that counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


@built
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 256])
@pytest.mark.parametrize("hidden", [32, 40, 256, 1024])
def test_rms_norm_is_the_eager_op(dtype, rows, hidden):
    x, weight = randn(rows, hidden, dtype=dtype), randn(hidden, dtype=dtype, seed=2)
    expected = rms_norm.eager(x, weight, 1e-6)
    out = NATIVE[rms_norm](x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, expected)


@built
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 256])
@pytest.mark.parametrize("hidden", [32, 40, 256, 1024])
def test_add_rms_norm_is_the_eager_op_and_leaves_its_inputs(dtype, rows, hidden):
    x, residual = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype, seed=3)
    weight = randn(hidden, dtype=dtype, seed=2)
    inputs = [t.clone() for t in (x, residual, weight)]
    normed, total = NATIVE[add_rms_norm](x, residual, weight, 1e-6)
    expected_normed, expected_total = add_rms_norm.eager(x, residual, weight, 1e-6)
    assert torch.equal(total, expected_total) and torch.equal(normed, expected_normed)
    assert all(torch.equal(a, b) for a, b in zip((x, residual, weight), inputs))


@qkv_cases
def test_q_and_k_norm_over_each_head_of_a_qkv_view(dtype, rows, heads, kv_heads, head_dim):
    q, k = qk_views(rows, heads, kv_heads, head_dim, dtype)
    weight = randn(head_dim, dtype=dtype, seed=2)
    for x in (q, k):
        assert torch.equal(NATIVE[rms_norm](x, weight, 1e-6), rms_norm.eager(x, weight, 1e-6))


@built
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [8192, 300_001])
def test_long_rows_sum_in_pytorchs_order(dtype, hidden):
    """Rows long enough for the second, third and fourth levels of PyTorch's cascade sum."""
    x, weight = randn(2, hidden, dtype=dtype), randn(hidden, dtype=dtype, seed=2)
    assert torch.equal(NATIVE[rms_norm](x, weight, 1e-6), rms_norm.eager(x, weight, 1e-6))


@built
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_around_the_vector_width_sum_in_pytorchs_order(dtype):
    """Rows under, at and past a float vector (8 lanes; on AVX-512 CPUs too, whose PyTorch
    sums with its AVX2 kernel), past 4 and 16 rows of 4 vectors (a second level): 64 rows
    each, so that a wrong lane count or tail order shows in some row's last bit."""
    for hidden in (*range(1, 18), 31, 33, 63, 65, 127, 129, 511, 513, 4095):
        x, weight = randn(64, hidden, dtype=dtype, seed=hidden), randn(hidden, dtype=dtype, seed=2)
        out = NATIVE[rms_norm](x, weight, 1e-6)
        assert torch.equal(out, rms_norm.eager(x, weight, 1e-6)), f"hidden {hidden}"


@built
def test_a_lone_long_row_on_two_threads_is_the_eager_op():
    """PyTorch splits the sum of a single row of 32768 elements or more over its threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seed in range(4):  # seeds 0 and 2 differed in the last bit before the fallback
            x, weight = randn(1, 40_000, seed=seed), randn(40_000, seed=9)
            assert torch.equal(NATIVE[rms_norm](x, weight, 1e-6), rms_norm.eager(x, weight, 1e-6))
    finally:
        torch.set_num_threads(threads)


@built
def test_eps_is_honoured():
    x, weight = 1e-3 * randn(4, 64), randn(64, seed=2)
    small, large = NATIVE[rms_norm](x, weight, 1e-6), NATIVE[rms_norm](x, weight, 1e-2)
    assert not torch.equal(small, large)
    assert torch.equal(large, rms_norm.eager(x, weight, 1e-2))
    assert torch.equal(
        NATIVE[add_rms_norm](x, x, weight, 1e-2)[0], add_rms_norm.eager(x, x, weight, 1e-2)[0]
    )


@qkv_cases
def test_rotary_is_the_eager_op_and_leaves_its_inputs(dtype, rows, heads, kv_heads, head_dim):
    q, k = qk_views(rows, heads, kv_heads, head_dim, dtype)
    cache = get_rope(head_dim, MAX_POSITION, {"rope_theta": 1e6}).cos_sin_cache
    positions = torch.randint(
        MAX_POSITION - 300, MAX_POSITION, (rows,), generator=torch.Generator().manual_seed(4)
    )
    positions[0] = MAX_POSITION - 1
    inputs = [t.clone() for t in (q, k, positions, cache)]
    q_out, k_out = NATIVE[apply_rotary_emb](positions, q, k, cache)
    expected_q, expected_k = apply_rotary_emb.eager(positions, q, k, cache)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert torch.equal(q_out, expected_q) and torch.equal(k_out, expected_k)
    assert all(torch.equal(a, b) for a, b in zip((q, k, positions, cache), inputs))


@built
def test_a_position_outside_the_cache_is_an_index_error():
    q, k = qk_views(3, 2, 1, 16, torch.float32)
    cache = get_rope(16, 64, {"rope_theta": 1e4}).cos_sin_cache
    with pytest.raises(IndexError, match="position 64"):
        NATIVE[apply_rotary_emb](torch.tensor([0, 64, 1]), q, k, cache)


@built
def test_two_threads_give_the_one_threads_result():
    """Above PyTorch's grain size (32768 elements) rows are spread over the threads."""
    x, weight = randn(256, 1024), randn(1024, seed=2)
    q, k = qk_views(256, 16, 8, 128, torch.float32)
    cache = get_rope(128, MAX_POSITION, {"rope_theta": 1e6}).cos_sin_cache
    positions = torch.arange(256)
    threads, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(
                (
                    NATIVE[rms_norm](x, weight, 1e-6),
                    *NATIVE[apply_rotary_emb](positions, q, k, cache),
                )
            )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_without_the_library_the_eager_ops_run(monkeypatch):
    monkeypatch.setattr(cpu_ops, "load", lambda: None)
    x, weight = randn(3, 40), randn(40, seed=2)
    q, k = qk_views(3, 2, 1, 16, torch.float32)
    cache = get_rope(16, 64, {"rope_theta": 1e4}).cos_sin_cache
    for op, args in (
        (rms_norm, (x, weight, 1e-6)),
        (add_rms_norm, (x, x, weight, 1e-6)),
        (apply_rotary_emb, (torch.tensor([0, 5, 63]), q, k, cache)),
    ):
        eager = Spy(op.eager)
        out = NATIVE[op].func(eager, *args)  # the twin, given the spy as its eager op
        assert eager.calls == 1 and torch.equal(out[0], op.eager(*args)[0])


def unindexed_cases() -> dict:
    """Inputs the C++ does not take: name -> (op, args)."""
    x, weight, residual = randn(3, 64), randn(64, seed=2), randn(3, 64, seed=3)
    q, k = qk_views(3, 2, 1, 32, torch.float16)
    cache = get_rope(32, 64, {"rope_theta": 1e4}).cos_sin_cache
    return {
        "float16": (rms_norm, (x.half(), weight.half(), 1e-6)),
        "a weight of another dtype": (rms_norm, (x.bfloat16(), weight, 1e-6)),
        "a strided last dim": (rms_norm, (randn(3, 128)[:, ::2], weight, 1e-6)),
        "one dimension": (rms_norm, (x[0], weight, 1e-6)),
        "a residual of another dtype": (add_rms_norm, (x, residual.bfloat16(), weight, 1e-6)),
        "float16 rotary": (apply_rotary_emb, (torch.arange(3), q, k, cache)),
        "int32 positions": (
            apply_rotary_emb,
            (torch.arange(3, dtype=torch.int32), q.float(), k.float(), cache),
        ),
    }


@pytest.mark.parametrize("case", list(unindexed_cases()))
def test_what_the_kernel_does_not_index_runs_eagerly(case):
    op, args = unindexed_cases()[case]
    eager = Spy(op.eager)
    out = NATIVE[op].func(eager, *args)
    assert eager.calls == 1 and torch.equal(out[0], op.eager(*args)[0])
