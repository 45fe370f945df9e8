"""The hot ops' Triton kernels (kernels/fused_ops.py) against the eager ops they stand for: the
same result in every dtype, bit for bit where only roundings of 16-bit numbers are involved, and
the engine with all four of them in its layers gives transformers' greedy tokens."""

import pytest
import torch
from conftest import hf_greedy
from kernel_cases import DEVICE, randn, requires_kernels

from nanovllm import LLM, SamplingParams
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.layernorm import add_rms_norm, rms_norm
from nanovllm.layers.rotary_embedding import apply_rotary_emb, get_rope

pytestmark = [pytest.mark.cuda, requires_kernels]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_as_eager(out: torch.Tensor, ref: torch.Tensor) -> None:
    """16-bit: within one rounding of the dtype and bit-equal almost everywhere (the float32 math
    under a rounding may differ by a unit: exp, rsqrt, a sum's order); float32: as close as
    test_cuda holds compiled ops to eager ones (a GPU's exp is approximate: a few units of
    float32's last place, more for large arguments; a GPU may fuse a product and a sum, which
    near a cancellation counts at the operands' scale)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.dtype == torch.float32:
        atol = 1e-6 * ref.abs().max().item()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=atol)
        return
    rtol = torch.finfo(ref.dtype).eps
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=1e-30)
    assert (out == ref).float().mean().item() >= 0.99


def qkv_views(tokens, heads, kv_heads, head_dim, dtype, gen):
    """q and k as the model has them: views of one qkv projection's rows."""
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, gen=gen)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    return q, k


def norm_weight(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return 1 + randn(n, dtype=dtype, gen=gen, scale=0.2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "tokens,hidden,scale",
    [(1, 96, 3.0), (37, 1024, 3.0), (4, 64, 1e-3)],  # 1e-3: mean(x^2) near eps, which counts
)
def test_rms_norm_and_its_residual_add_match_the_eager_ops(dtype, tokens, hidden, scale):
    from nanovllm.kernels import fused_ops

    gen = torch.Generator().manual_seed(tokens)
    x, residual = (randn(tokens, hidden, dtype=dtype, gen=gen, scale=scale) for _ in range(2))
    weight = norm_weight(hidden, dtype, gen)
    assert_as_eager(fused_ops.rms_norm(x, weight, 1e-6), rms_norm.eager(x, weight, 1e-6))
    out, summed = fused_ops.add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_summed = add_rms_norm.eager(x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed)  # one rounding of an exact float32 sum
    assert_as_eager(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_norm_over_each_head_of_a_qkv_view_matches_the_eager_op(dtype):
    from nanovllm.kernels import fused_ops

    gen = torch.Generator().manual_seed(1)
    q, k = qkv_views(9, 4, 2, 64, dtype, gen)
    weight = norm_weight(64, dtype, gen)
    for x in (q, k):
        assert_as_eager(fused_ops.rms_norm(x, weight, 1e-6), rms_norm.eager(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,d", [(1, 100), (5, 1536)])  # 1536: two column blocks a row
def test_silu_and_mul_matches_the_eager_op(dtype, tokens, d):
    from nanovllm.kernels import fused_ops

    gen = torch.Generator().manual_seed(d)
    x = randn(tokens, 2 * d, dtype=dtype, gen=gen, scale=4.0)
    assert_as_eager(fused_ops.silu_and_mul(x), silu_and_mul.eager(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (16, 8, 128), (3, 1, 32)])
def test_rotary_matches_the_eager_op_bit_for_bit_in_16_bits(dtype, heads, kv_heads, head_dim):
    from nanovllm.kernels import fused_ops

    gen = torch.Generator().manual_seed(head_dim)
    q, k = qkv_views(11, heads, kv_heads, head_dim, dtype, gen)
    cache = get_rope(head_dim, 4096, {"rope_theta": 1e6}).cos_sin_cache.to(DEVICE)
    positions = torch.randint(0, 4096, (11,), generator=gen).to(DEVICE)
    out = fused_ops.apply_rotary_emb(positions, q, k, cache)
    ref = apply_rotary_emb.eager(positions, q, k, cache)
    for o, r in zip(out, ref):
        if dtype == torch.float32:
            assert_as_eager(o, r)
        else:
            assert torch.equal(o, r)
        assert o.stride() == r.stride()  # views of one [tokens, heads + kv_heads, dim] tensor


def test_no_tokens_give_empty_results():
    from nanovllm.kernels import fused_ops

    x, w = torch.empty(0, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    assert fused_ops.rms_norm(x, w, 1e-6).shape == (0, 64)
    assert [t.shape for t in fused_ops.add_rms_norm(x, x, w, 1e-6)] == [(0, 64)] * 2
    assert fused_ops.silu_and_mul(x).shape == (0, 32)
    q, cache = torch.empty(0, 2, 64, device=DEVICE), torch.zeros(8, 2, 64, device=DEVICE)
    positions = torch.empty(0, dtype=torch.long, device=DEVICE)
    assert [t.shape for t in fused_ops.apply_rotary_emb(positions, q, q, cache)] == [(0, 2, 64)] * 2


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda F, x, w: F.rms_norm(x[0], w, 1e-6), r"x must be \[tokens, hidden\]"),
        (lambda F, x, w: F.rms_norm(x, w[:32], 1e-6), r"weight's 32 is not x's last dim 64"),
        (lambda F, x, w: F.rms_norm(x, w.double(), 1e-6), r"weight must be a 1-D float"),
        (lambda F, x, w: F.add_rms_norm(x, x[:1], w, 1e-6), r"residual .* is not x's"),
        (lambda F, x, w: F.silu_and_mul(x[:, :63]), r"x's last dim must be even"),
        (
            lambda F, x, w: F.apply_rotary_emb(
                torch.zeros(2, dtype=torch.long, device=DEVICE),
                x.view(2, 2, 32),
                x.view(2, 2, 32),
                torch.zeros(8, 2, 32, dtype=torch.float64, device=DEVICE),
            ),
            r"cos_sin_cache must be contiguous float32",
        ),
    ],
)
def test_bad_layout_fails_an_assertion_naming_it(call, match):
    from nanovllm.kernels import fused_ops

    x, w = torch.zeros(2, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    with pytest.raises(AssertionError, match=match):
        call(fused_ops, x, w)


@pytest.fixture
def triton_hot_ops(monkeypatch):
    """Every hot op that has a Triton kernel runs it: on CUDA through the platform's choice, on
    a CPU (the interpreter) through the CUDA platform's eager choice in the CPU platform's place."""
    from nanovllm.platforms import cuda
    from nanovllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(cuda, "TRITON_HOT_OPS", frozenset(cuda.FUSED_OPS))
    if DEVICE == "cpu":
        monkeypatch.setattr(CpuPlatform, "op_choice", lambda self: cuda.eager_cuda_ops)


def test_the_engine_with_the_triton_hot_ops_gives_transformers_greedy_tokens(
    checkpoints, triton_hot_ops
):
    """Qwen3 (q/k norms), graphs on CUDA: every layer's norms, SiLU-and-mul and rotary are the
    kernels, through prefill and decode."""
    from nanovllm.kernels import fused_ops
    from nanovllm.layers.activation import SiluAndMul
    from nanovllm.layers.layernorm import RMSNorm
    from nanovllm.layers.rotary_embedding import RotaryEmbedding

    path = str(checkpoints["gqa"])
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 9, 23)]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with LLM(
        path,
        device=DEVICE,
        dtype="float32",
        kvcache_block_size=16,
        num_kvcache_blocks=32,
        max_num_seqs=4,
        cpu_decode_step=False,  # a CPU's native step would skip the layers
    ) as llm:
        modules = list(llm.model_runner.model.modules())
        assert all(m._fn is fused_ops.silu_and_mul for m in modules if isinstance(m, SiluAndMul))
        norms = [m for m in modules if isinstance(m, RMSNorm)]
        assert norms and all(m._add_norm is fused_ops.add_rms_norm for m in norms)
        assert all(
            m._fn is fused_ops.apply_rotary_emb for m in modules if isinstance(m, RotaryEmbedding)
        )
        tokens = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert tokens == [hf_greedy(path, tuple(p), greedy.max_tokens) for p in prompts]
