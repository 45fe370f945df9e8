"""fused_moe (the Triton grouped GEMM) against fused_moe_torch, the reference in
models/moe.py: random routing with experts that get no token, one token, many; both
block sizes; the sort it does before the GEMMs; launcher checks.

The 16-bit case is float16: Triton's interpreter truncates float32 -> bfloat16 where a
GPU rounds to nearest, which alone costs the three roundings of a MoE ~1e-2 of relative
error, so bfloat16 runs on CUDA only."""

import pytest
import torch
from kernel_cases import DEVICE, INTERPRET, TOLERANCE, rel_error, requires_kernels

pytestmark = [pytest.mark.cuda, requires_kernels]
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRET, reason="truncates")),
]


def moe_case(
    num_tokens: int,
    hidden: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> dict:
    from nanovllm.models.moe import select_experts

    gen = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(num_tokens, num_experts, generator=gen)
    topk_weights, topk_ids = select_experts(logits, top_k, renormalize=True)
    case = dict(
        hidden_states=torch.randn(num_tokens, hidden, generator=gen),
        w13=torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5,
        w2=torch.randn(num_experts, hidden, intermediate, generator=gen) / intermediate**0.5,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
    )
    return {
        k: v.to(DEVICE, dtype) if v.is_floating_point() else v.to(DEVICE) for k, v in case.items()
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,hidden,intermediate,num_experts,top_k,block_m",
    [
        (1, 32, 16, 4, 1, None),  # one decode token
        (5, 64, 48, 16, 2, None),  # most experts idle; N not a multiple of the tile
        (37, 48, 40, 8, 3, 16),  # K not a power of two
        (70, 32, 32, 4, 2, 64),  # several blocks per expert
    ],
)
def test_fused_moe_matches_the_torch_reference(
    dtype, num_tokens, hidden, intermediate, num_experts, top_k, block_m
):
    from nanovllm.kernels import fused_moe
    from nanovllm.models.moe import fused_moe_torch

    case = moe_case(num_tokens, hidden, intermediate, num_experts, top_k, dtype)
    out = fused_moe(**case, block_m=block_m)
    ref = fused_moe_torch(**{k: v.float() if v.is_floating_point() else v for k, v in case.items()})
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    assert rel_error(out, ref) < TOLERANCE[dtype]


def test_align_by_expert_groups_pairs_by_expert_in_blocks():
    from nanovllm.kernels.fused_moe import align_by_expert

    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)  # pairs 0..5
    sorted_ids, expert_ids = align_by_expert(topk_ids, num_experts=5, block_m=2)
    pad = 6
    # expert 0: pairs 1, 4; expert 2: pairs 0, 2, 5 (+ a pad); expert 3: pair 3 (+ a pad)
    assert sorted_ids.tolist()[:8] == [1, 4, 0, 2, 5, pad, 3, pad]
    assert set(sorted_ids.tolist()[8:]) <= {pad}
    assert expert_ids.tolist()[:4] == [0, 2, 2, 3] and set(expert_ids.tolist()[4:]) <= {-1}


def test_no_tokens_give_an_empty_output():
    from nanovllm.kernels import fused_moe

    case = moe_case(0, 32, 16, 4, 2, torch.float32)
    assert fused_moe(**case).shape == (0, 32)


@pytest.mark.parametrize(
    "name,change,match",
    [
        ("hidden_states", lambda t: t[0], r"hidden_states must be a 2-D float tensor"),
        ("w13", lambda t: t[:, :-2], r"w13's shape"),
        (
            "w2",
            lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),
            r"w2 must be .* contiguous last",
        ),
        ("w2", lambda t: t.half(), r"w2 is torch.float16 .*, not torch.float32"),
        ("topk_ids", lambda t: t.float(), r"topk_ids must be a contiguous 2-D int32/int64"),
        ("topk_ids", lambda t: t[:1], r"topk_ids .* of 3 rows"),
        ("topk_weights", lambda t: t[:, :1].contiguous(), r"topk_weights' shape"),
    ],
)
def test_bad_layout_fails_an_assertion_naming_it(name, change, match):
    from nanovllm.kernels import fused_moe

    case = moe_case(3, 32, 16, 4, 2, torch.float32)
    case[name] = change(case[name])
    with pytest.raises(AssertionError, match=match):
        fused_moe(**case)


@pytest.mark.skipif(DEVICE != "cuda", reason="the engine picks the kernel on CUDA only")
def test_qwen3_moe_engine_on_cuda_with_graphs_matches_transformers(tmp_path):
    """The kernel inside the model, decode steps replayed from CUDA graphs."""
    from conftest import hf_greedy
    from families import build_family_checkpoint, build_tokenizer_once

    from nanovllm import LLM, SamplingParams

    path = build_family_checkpoint(
        tmp_path / "moe", "qwen3_moe", build_tokenizer_once(tmp_path / "tokenizer")
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 17, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(
        str(path), device="cuda", kvcache_block_size=16, num_kvcache_blocks=32, max_num_seqs=4
    ) as llm:
        assert llm.model_runner.fast_decode is not None
        out = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert out == [hf_greedy(str(path), tuple(p), 8) for p in prompts]
