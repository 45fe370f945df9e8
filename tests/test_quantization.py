"""Int8 and int4 weight-only quantization (quantization/int8.py, int4.py), against independent
oracles:

- exact: transformers' model with each linear weight replaced by its dequantized copy (the same
  rule, per channel for int8 and per channel and group of 128 (or 64) for int4, written out
  here) gives our quantized engine's prefill logits, to float32 rounding, for every family; and
  int4 generation is the float engine's on a checkpoint of the dequantized weights;
- statistical: against the float32 engine, the logits move by about the quantization error, and
  a greedy token differs only where the float model's top two logits lie within twice that
  error of each other;
- refusals: an unknown method, and a device other than the CPU.
"""

import copy
import json
import math
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import hf_model
from families import FAMILIES

from nanovllm import LLM, SamplingParams
from nanovllm.core.sequence import Sequence
from nanovllm.kernels import cpu_int4
from nanovllm.platforms import Placement, Platform
from nanovllm.quantization.int4 import Int4Weight, layer_group_size
from nanovllm.quantization.int8 import Int8Weight
from nanovllm.runner.step_inputs import prepare_inputs

BLOCK = 16
PROMPT_LENGTHS = (1, BLOCK + 1, 40, 100)
# Each prefill's logits in float32 through a different summation order than transformers' (the
# kernel's tiles, MKL's blocks): the float engine agrees with transformers to ~1e-6 and within
# 1e-5 (test_model_families); the int8 kernel's float32 dot products over these K <= 128 sums add
# at most a few ulps more of values below ~10, and the int4 kernel's exact integer ones as much
# (x rounded to 23 bits below its group's largest value: tests/kernels/test_cpu_int4.py).
EXACT_TOLERANCE = 1e-4
METHODS = ("int8", "int4")


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def reference_int8(weight: torch.Tensor) -> torch.Tensor:
    """The dequantized int8 weight, per output row: scale = max |w| / 127, q = round(w / scale)."""
    w = weight.double()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(w / scale).clamp(-127, 127) * scale).to(weight.dtype)


def reference_int4(weight: torch.Tensor) -> torch.Tensor:
    """The dequantized int4 weight, per row and group of 128 channels (their largest common
    divisor with in_features, 64 here for a layer of 64): offset = the group's least weight,
    scale = its range / 15 (float32), q = round((w - offset) / scale); scale q + offset exact,
    then rounded to float32 (the kernel sums with the exact value)."""
    n, k = weight.shape
    size = math.gcd(k, 128)
    w = weight.double().view(n, k // size, size)
    offset = w.amin(dim=2, keepdim=True)
    scale = ((w.amax(dim=2, keepdim=True) - offset) / 15).float().double()
    q = torch.round((w - offset) / scale.clamp_min(1e-300)).clamp(0, 15)
    return (scale * q + offset).view(n, k).to(weight.dtype)


REFERENCES = {"int8": reference_int8, "int4": reference_int4}


def hf_quantized_model(path: str, method: str):
    """transformers' model with every linear weight (the LM head's too, untied from the
    embedding, which stays float) replaced by its reference dequantized copy: what our engine
    computes. (No family here has weights the int4 path would skip: MoE's are not nn.Linear in
    the engine, and stay float in both.)"""
    model = copy.deepcopy(hf_model(path))
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not _moe_float(name):
            module.weight = torch.nn.Parameter(REFERENCES[method](module.weight.detach()))
    return model


def _moe_float(name: str) -> bool:
    """An MoE router or expert, which stays float (a Qwen3-MoE layer's mlp.gate, mlp.experts)."""
    return re.search(r"mlp\.(gate|experts)\b", name) is not None


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


def assert_two_ranks_decode_as_one(path) -> None:
    """Greedy tokens with tensor_parallel_size=2 are one rank's (each rank's shards of the
    quantized tensors read as the whole layer is)."""
    prompts = make_prompts((5, 30))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with engine(path) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with engine(path, tensor_parallel_size=2) as llm:
        split = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert split == alone


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


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied", *FAMILIES])
def test_logits_are_transformers_with_the_dequantized_weights(all_checkpoints, name, method):
    path, prompts = all_checkpoints[name], make_prompts()
    with engine(path, quantization=method) as llm:
        ours = prefill_logits(llm, prompts)
    with torch.inference_mode():
        model = hf_quantized_model(str(path), method)
        theirs = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
        float_logits = torch.stack(
            [hf_model(str(path))(torch.tensor([p])).logits[0, -1] for p in prompts]
        )
    assert (ours - theirs).abs().max().item() < EXACT_TOLERANCE
    assert (ours - float_logits).abs().max().item() > 10 * EXACT_TOLERANCE  # it did quantize


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["qwen3", *FAMILIES])
def test_greedy_tokens_differ_from_float_only_at_near_ties(all_checkpoints, name, method):
    """A greedy step can flip only where the float model's top-2 gap is within the logits'
    error; everywhere else the quantized engine picks the float model's token."""
    path, prompts = all_checkpoints[name], make_prompts(seed=3)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with engine(path) as llm:
        float_logits = prefill_logits(llm, prompts)
        float_tokens = [o["token_ids"][0] for o in llm.generate(prompts, params, use_tqdm=False)]
    with engine(path, quantization=method) as llm:
        quantized_logits = prefill_logits(llm, prompts)
        tokens = [o["token_ids"][0] for o in llm.generate(prompts, params, use_tqdm=False)]
    error = (quantized_logits - float_logits).abs().max().item()
    top2 = float_logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    for prompt, gap, ours, theirs in zip(prompts, gaps, tokens, float_tokens):
        assert ours == theirs or gap <= 2 * error, (len(prompt), gap, error)


def dequantized_checkpoint(path, dst) -> str:
    """A float checkpoint of `path` whose linear weights are their int4 copies dequantized
    (reference_int4; the LM head untied: a tied embedding stays float, as in the engine)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    files = sorted(dst.glob("*.safetensors"))
    for file in files:
        tensors = load_file(file)
        for name, tensor in tensors.items():
            if re.search(r"(_proj|lm_head)\.weight$", name):
                tensors[name] = reference_int4(tensor)
        if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = reference_int4(tensors["model.embed_tokens.weight"])
        save_file(tensors, file, metadata={"format": "pt"})
    assert len(files) == 1  # the lm_head of a tied, sharded checkpoint would need its index
    (dst / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    return str(dst)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied", "llama_bias"])
def test_int4_generation_is_the_float_engine_on_the_dequantized_weights(
    all_checkpoints, name, tmp_path
):
    """Without transformers: the int4 engine (its native decode step, batches of 1-3 rows)
    decodes the float engine's greedy tokens on a checkpoint of the dequantized weights, its
    logprobs within 1e-4; a token may differ only at a near-tie of the float engine's."""
    path = all_checkpoints[name]
    reference = dequantized_checkpoint(path, tmp_path / name)
    prompts = [{"prompt_token_ids": p} for p in make_prompts((4, 11, 23), seed=5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    with engine(path, quantization="int4", dtype="float32") as llm:
        assert llm.model_runner.fast_decode is not None  # the native step decodes
        ours = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    with engine(reference, dtype="float32") as llm:
        theirs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(ours, theirs):
        for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            if a.token_ids[step] != b.token_ids[step]:  # a near-tie, then nothing to compare
                top2 = sorted((p.logprob for p in y.values()), reverse=True)[:2]
                assert top2[0] - top2[1] < 1e-4, (name, step)
                break
            token = a.token_ids[step]
            assert abs(x[token].logprob - y[token].logprob) < 1e-4, (name, step)


def test_an_unknown_method_is_refused_by_name(checkpoints):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(checkpoints["gqa"]), quantization="int3")


@pytest.mark.parametrize("method", METHODS)
def test_quantization_off_the_cpu_is_refused(checkpoints, method):
    """A platform other than the CPU's (CUDA's, here one on the meta device) has no int8 or
    int4 GEMM."""
    from transformers import AutoConfig

    from nanovllm.models.registry import get_model_class

    class Elsewhere(Platform):
        device = torch.device("meta")

    config = AutoConfig.from_pretrained(checkpoints["gqa"])
    with torch.device("meta"):
        model = get_model_class(config)(config)
    platform = Elsewhere(SimpleNamespace(quantization=method), Placement(None, 1, 1))
    with pytest.raises(ValueError, match="runs on a CPU"):
        platform.prepare_weights(model)


@pytest.mark.parametrize("method,format_class", [("int8", Int8Weight), ("int4", Int4Weight)])
def test_the_float_weights_are_freed_but_a_tied_embedding_kept(checkpoints, method, format_class):
    with engine(checkpoints["mqa"], quantization=method) as llm:  # mqa: a tied LM head
        model = llm.model_runner.model
        layers = [
            m
            for m in model.modules()
            if isinstance(getattr(m, "weight_format", None), format_class)
        ]
        assert len(layers) == 4 * 2 + 1  # qkv, o, gate_up, down of 2 layers; the LM head
        assert all(m.weight_format.library is not None for m in layers)  # the C++ kernel
        assert model.model.embed_tokens.weight.numel() > 0  # the embedding reads float rows
        assert all(m.weight.numel() == 0 for m in layers if m is not model.lm_head)
        if method == "int4":  # half a byte a weight, its groups' scales and offsets beside
            weights = sum(
                m.weight_format.out_features * m.weight_format.in_features for m in layers
            )
            packed = sum(m.weight_format.packed.numel() for m in layers)
            assert weights / 2 < packed < weights


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


def test_a_long_prefill_takes_the_dequantized_int4_copy_and_agrees_with_the_kernel():
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(130, 96, generator=g), torch.randn(40, 96, generator=g)
    layer = Int4Weight.from_float(weight, 32)
    q, scale, offset = cpu_int4.quantize(weight, 32)
    assert all(torch.equal(a, b) for a, b in zip(layer.canonical(), (q, scale, offset)))
    by_kernel = layer.linear(x, None)
    layer.max_rows = 8  # 40 rows: past it
    by_copy = layer.linear(x, None)
    reference = x.double() @ cpu_int4.dequantize(q, scale, offset, 32).double().T
    bound = 1e-5 * (x.abs() @ weight.abs().T).double()  # float32 sums of 96 terms
    assert ((by_kernel - reference).abs() <= bound).all()
    assert ((by_copy - reference).abs() <= bound).all()
    assert not torch.equal(by_kernel, by_copy)  # two ways


def test_int4_weight_is_made_from_the_canonical_tensors_loaders_give():
    """What the GPTQ, AWQ and GGUF loaders call: Int4Weight(q, scale, offset, group_size), here
    a symmetric grid (offset = -8 scale); dequantize() is the weight they stand for."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (70, 256), generator=g, dtype=torch.uint8)
    scale = torch.rand(70, 2, generator=g) + 0.1
    layer = Int4Weight(q, scale, -8 * scale, 128)
    weight = (q.double().view(70, 2, 128) - 8) * scale.double()[..., None]  # exact
    dequantized = layer.dequantize().view(70, 2, 128)  # scale q + offset in float32: 2 roundings
    assert ((dequantized - weight).abs() <= 2.0**-20 * scale[..., None]).all()
    x = torch.randn(3, 256, generator=g)
    y = layer.linear(x, None)
    exact = x.double() @ weight.view(70, 256).T
    assert ((y - exact).abs() <= 1e-5 * (x.abs().double() @ weight.view(70, 256).abs().T)).all()
    with pytest.raises(ValueError, match="q must hold values 0..15"):
        Int4Weight(q | 16, scale, -8 * scale, 128)
    with pytest.raises(ValueError, match=r"scale must be \[70, 2\]"):
        Int4Weight(q, scale.T, -8 * scale, 128)
    with pytest.raises(ValueError, match="not a multiple of group_size 96"):
        Int4Weight(q, scale, -8 * scale, 96)


def test_a_layer_takes_the_largest_group_size_dividing_its_inputs():
    """128 where it divides in_features; a small model's 64 or 96 take 64 and 32; 48 has no
    group of 32, 64, 128...: refused, naming the layer."""
    assert layer_group_size("a", 3072, 128) == 128
    assert layer_group_size("a", 64, 128) == 64
    assert layer_group_size("a", 96, 128) == 32
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj: in_features 48"):
        layer_group_size("model.layers.0.mlp.down_proj", 48, 128)


def test_without_the_kernel_int4_weights_run_dequantized_through_f_linear(monkeypatch):
    """Where cpu_int4 cannot be built (no compiler): the canonical tensors are kept, every call
    is F.linear on the dequantized weight, and the native step is not offered the layer."""
    monkeypatch.setattr(cpu_int4, "load", lambda: None)
    g = torch.Generator().manual_seed(2)
    weight, x = torch.randn(70, 64, generator=g), torch.randn(3, 64, generator=g)
    layer = Int4Weight.from_float(weight, 32)
    assert layer.packed is None and layer.native_linear(None) is None
    expected = torch.nn.functional.linear(x, cpu_int4.dequantize(*layer.canonical(), 32))
    assert torch.equal(layer.linear(x, None), expected)
