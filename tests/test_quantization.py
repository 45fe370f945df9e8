"""Int8 weight-only quantization (quantization/int8.py), against independent oracles:

- exact: transformers' model with each linear weight replaced by its dequantized int8 copy (the
  same per-channel rule, written out here) gives our int8 engine's prefill logits, to float32
  rounding, for every family;
- statistical: against the float32 engine, the logits move by about the quantization error, and
  a greedy token differs only where the float model's top two logits lie within twice that
  error of each other;
- refusals: an unknown method, and a device other than the CPU.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import hf_model
from families import FAMILIES

from nanovllm import LLM, SamplingParams
from nanovllm.core.sequence import Sequence
from nanovllm.platforms import Placement, Platform
from nanovllm.quantization.int8 import Int8Weight
from nanovllm.runner.step_inputs import prepare_inputs

BLOCK = 16
PROMPT_LENGTHS = (1, BLOCK + 1, 40, 100)
# Each prefill's logits in float32 through a different summation order than transformers' (the
# kernel's tiles, MKL's blocks): the float engine agrees with transformers to ~1e-6 and within
# 1e-5 (test_model_families); the int8 kernel's float32 dot products over these K <= 128 sums add
# at most a few ulps more of values below ~10.
EXACT_TOLERANCE = 1e-4


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def reference_int8(weight: torch.Tensor) -> torch.Tensor:
    """The dequantized int8 weight, per output row: scale = max |w| / 127, q = round(w / scale)."""
    w = weight.double()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(w / scale).clamp(-127, 127) * scale).to(weight.dtype)


def hf_int8_model(path: str):
    """transformers' model with every linear weight (the LM head's too, untied from the
    embedding, which stays float) replaced by reference_int8 of it: what our engine computes."""
    model = copy.deepcopy(hf_model(path))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(reference_int8(module.weight.detach()))
    return model


def prefill_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    runner, block_manager = llm.model_runner, llm.scheduler.block_manager
    seqs = []
    for prompt in prompts:
        seq = Sequence(prompt, SamplingParams(), BLOCK)
        block_manager.allocate(seq, [])
        seq.num_scheduled_tokens = len(prompt)
        seqs.append(seq)
    with torch.inference_mode():
        return runner.forward(prepare_inputs(seqs, BLOCK))


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=64, **kwargs)


def assert_greedy_tokens_are(oracle, path, prompt: list[int], n: int = 10) -> None:
    """Our greedy tokens on `path`, with the native decode step and without, are those of
    `oracle` (a transformers model) generating greedily."""
    out = oracle.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    expected = out[0, len(prompt) :].tolist()
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for step in (True, False):
        with engine(path, cpu_decode_step=step) as llm:
            got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == expected, f"cpu_decode_step={step}"


@pytest.fixture(scope="module")
def all_checkpoints(checkpoints, families) -> dict:
    return {"qwen3": checkpoints["gqa"], "qwen3_tied": checkpoints["mqa"], **families}


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied", *FAMILIES])
def test_int8_logits_are_transformers_with_the_dequantized_weights(all_checkpoints, name):
    path, prompts = all_checkpoints[name], make_prompts()
    with engine(path, quantization="int8") as llm:
        ours = prefill_logits(llm, prompts)
    with torch.inference_mode():
        theirs = torch.stack(
            [hf_int8_model(str(path))(torch.tensor([p])).logits[0, -1] for p in prompts]
        )
        float_logits = torch.stack(
            [hf_model(str(path))(torch.tensor([p])).logits[0, -1] for p in prompts]
        )
    assert (ours - theirs).abs().max().item() < EXACT_TOLERANCE
    assert (ours - float_logits).abs().max().item() > 10 * EXACT_TOLERANCE  # it did quantize


@pytest.mark.parametrize("name", ["qwen3", *FAMILIES])
def test_greedy_tokens_differ_from_float_only_at_near_ties(all_checkpoints, name):
    """A greedy step can flip only where the float model's top-2 gap is within the logits'
    error; everywhere else the int8 engine picks the float model's token."""
    path, prompts = all_checkpoints[name], make_prompts(seed=3)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with engine(path) as llm:
        float_logits = prefill_logits(llm, prompts)
        float_tokens = [o["token_ids"][0] for o in llm.generate(prompts, params, use_tqdm=False)]
    with engine(path, quantization="int8") as llm:
        int8_logits = prefill_logits(llm, prompts)
        int8_tokens = [o["token_ids"][0] for o in llm.generate(prompts, params, use_tqdm=False)]
    error = (int8_logits - float_logits).abs().max().item()
    top2 = float_logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    for prompt, gap, ours, theirs in zip(prompts, gaps, int8_tokens, float_tokens):
        assert ours == theirs or gap <= 2 * error, (len(prompt), gap, error)


def test_an_unknown_method_is_refused_by_name(checkpoints):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(checkpoints["gqa"]), quantization="int4")


def test_int8_off_the_cpu_is_refused(checkpoints):
    """A platform other than the CPU's (CUDA's, here one on the meta device) has no int8 GEMM."""
    from transformers import AutoConfig

    from nanovllm.models.registry import get_model_class

    class Elsewhere(Platform):
        device = torch.device("meta")

    config = AutoConfig.from_pretrained(checkpoints["gqa"])
    with torch.device("meta"):
        model = get_model_class(config)(config)
    platform = Elsewhere(SimpleNamespace(quantization="int8"), Placement(None, 1, 1))
    with pytest.raises(ValueError, match="runs on a CPU"):
        platform.prepare_weights(model)


def test_the_float_weights_are_freed_but_a_tied_embedding_kept(checkpoints):
    with engine(checkpoints["mqa"], quantization="int8") as llm:  # mqa: a tied LM head
        model = llm.model_runner.model
        layers = [
            m for m in model.modules() if isinstance(getattr(m, "weight_format", None), Int8Weight)
        ]
        assert layers and all(m.weight_format.qweight.dtype == torch.int8 for m in layers)
        assert all(m.weight_format.library is not None for m in layers)  # the C++ kernel
        assert model.model.embed_tokens.weight.numel() > 0  # the embedding reads float rows
        assert all(m.weight.numel() == 0 for m in layers if m is not model.lm_head)


def test_a_long_prefill_takes_the_dequantized_copy_and_agrees_with_the_kernel(monkeypatch):
    from nanovllm.kernels import cpu_int8

    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(130, 70, generator=g), torch.randn(40, 70, generator=g)
    layer = Int8Weight(weight)
    qweight, scale = cpu_int8.quantize(weight)
    assert torch.equal(layer.dense_qweight(), qweight)  # the panels hold the same int8 weight
    by_kernel = layer.linear(x, None)
    layer.max_rows = 8  # 40 rows: past it
    by_copy = layer.linear(x, None)
    reference = x.double() @ cpu_int8.dequantize(qweight, scale).double().T
    bound = 1e-5 * (x.abs() @ weight.abs().T).double()  # float32 sums of 70 terms
    assert ((by_kernel - reference).abs() <= bound).all()
    assert ((by_copy - reference).abs() <= bound).all()
