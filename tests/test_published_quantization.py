"""GPTQ and AWQ checkpoints (quantization/published.py), loaded as they are published.

The checkpoints are made here from the small random ones: each projection of every layer
quantized to 4 bits in groups (this file's own asymmetric rule) and packed as the formats' own
writers pack them (AutoGPTQ: along the inputs, zero points stored minus one in its v1 format;
AutoAWQ: along the outputs in the order 0 2 4 6 1 3 5 7), with the config each writes. The
oracle: transformers' model of the float checkpoint with each of those weights replaced by its
dequantized value, scale * (q - zero), computed here from the unpacked values; our engine's
prefill logits on the packed checkpoint must be its, to float32 rounding, and its greedy tokens
transformers' greedy tokens. Unsupported configs are refused by the field at fault.
"""

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hf_model
from safetensors.torch import load_file, save_file
from test_quantization import (
    EXACT_TOLERANCE,
    assert_greedy_tokens_are,
    assert_two_ranks_decode_as_one,
    engine,
    make_prompts,
    prefill_logits,
)

from nanovllm import LLM

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize(weight: torch.Tensor, group: int):
    """[N, K] -> q [N, K] in 0..15, scale [N, G] (float16, as stored), zero [N, G] in 0..15:
    each group's range mapped onto 0..15."""
    w = weight.double().reshape(weight.shape[0], -1, group)
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scale = ((high - low) / 15).clamp(min=1e-8).half()
    zero = torch.round(-low / scale.double()).clamp(0, 15)
    q = torch.round(w / scale.double().unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15)
    return q.reshape(weight.shape).to(torch.int64), scale, zero.to(torch.int64)


def dequantized(q, scale, zero, group: int) -> torch.Tensor:
    s = scale.double().repeat_interleave(group, 1)
    return (s * (q - zero.repeat_interleave(group, 1))).float()


def pack(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """int32s of 8 four-bit fields along `dim` of a 2-D tensor: field i of each is the value at
    position order[i] of its run of 8."""
    v = values.movedim(dim, -1).numpy().astype(np.uint64)
    runs = v.reshape(*v.shape[:-1], -1, 8)
    packed = sum(runs[..., order[i]] << np.uint64(4 * i) for i in range(8))
    as_int32 = torch.from_numpy(packed.astype(np.uint32).view(np.int32))
    return as_int32.movedim(-1, dim).contiguous()


def gptq_tensors(q, scale, zero, group: int, v1: bool) -> dict[str, torch.Tensor]:
    stored_zero = zero - 1 if v1 else zero  # AutoGPTQ's v1 format stores zero - 1
    in_features = q.shape[1]
    return {
        "qweight": pack(q.t(), 0),  # [K / 8, N]
        "qzeros": pack(stored_zero.t() & 0xF, 1),  # [G, N / 8]
        "scales": scale.t().contiguous(),  # [G, N]
        "g_idx": (torch.arange(in_features) // group).to(torch.int32),
    }


def awq_tensors(q, scale, zero, group: int) -> dict[str, torch.Tensor]:
    return {
        "qweight": pack(q.t(), 1, AWQ_ORDER),  # [K, N / 8]
        "qzeros": pack(zero.t(), 1, AWQ_ORDER),  # [G, N / 8]
        "scales": scale.t().contiguous(),
    }


def quantized_checkpoint(source: Path, out: Path, method: str, group: int = 32, **config):
    """`source` with every projection quantized and packed by `method` ("gptq", "gptq_v2",
    "awq"); returns the path and {tensor name: its dequantized weight}."""
    shutil.copytree(source, out)
    tensors = {}
    for file in sorted(out.glob("*.safetensors")):  # sharded or not: one file is written
        tensors.update(load_file(file))
        file.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    reference = {}
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in PROJECTIONS]:
        q, scale, zero = quantize(tensors[name], group)
        assert method != "gptq" or zero.min() >= 1, "v1 stores zero - 1: a zero of 0 cannot be"
        reference[name] = dequantized(q, scale, zero, group)
        layer = name.removesuffix(".weight")
        if method == "awq":
            parts = awq_tensors(q, scale, zero, group)
        else:
            parts = gptq_tensors(q, scale, zero, group, v1=method == "gptq")
        del tensors[name]
        tensors.update({f"{layer}.{part}": t for part, t in parts.items()})
    save_file(tensors, out / "model.safetensors")
    if method == "awq":
        quantization = dict(quant_method="awq", bits=4, group_size=group, zero_point=True)
        quantization["version"] = "gemm"
    else:
        quantization = dict(quant_method="gptq", bits=4, group_size=group, desc_act=False)
        quantization["sym"], quantization["checkpoint_format"] = False, method
    hf = json.loads((out / "config.json").read_text())
    hf["quantization_config"] = quantization | config
    (out / "config.json").write_text(json.dumps(hf))
    return out, reference


def hf_dequantized_model(source: Path, reference: dict[str, torch.Tensor]):
    model = copy.deepcopy(hf_model(str(source)))
    params = dict(model.named_parameters())
    for name, weight in reference.items():
        params[name].data.copy_(weight)
    return model


@pytest.fixture(scope="module")
def made(checkpoints, families, tmp_path_factory):
    """(method, family) -> (the quantized checkpoint, transformers' dequantized model)."""
    root = tmp_path_factory.mktemp("published")
    bases = {"qwen3": checkpoints["gqa"], "llama": families["llama"]}
    found = {}
    for method in ("gptq", "gptq_v2", "awq"):
        for family, base in bases.items():
            path, reference = quantized_checkpoint(base, root / f"{family}-{method}", method)
            found[method, family] = path, hf_dequantized_model(base, reference)
    return found


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("method", ["gptq", "gptq_v2", "awq"])
def test_logits_are_transformers_with_the_dequantized_weights(made, method, family):
    path, oracle = made[method, family]
    prompts = make_prompts()
    with engine(path) as llm:
        assert llm.config.quantization == method.removesuffix("_v2")
        logits = prefill_logits(llm, prompts)
    expected = [oracle(torch.tensor([p])).logits[0, -1] for p in prompts]
    torch.testing.assert_close(logits, torch.stack(expected), atol=EXACT_TOLERANCE, rtol=0)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_greedy_tokens_are_transformers_and_the_native_step_agrees(made, method):
    path, oracle = made[method, "qwen3"]
    assert_greedy_tokens_are(oracle, path, make_prompts((12,), seed=3)[0])


@pytest.mark.slow
def test_tensor_parallel_shards_the_groups_as_the_weights(made):
    path, _ = made["gptq", "qwen3"]
    assert_two_ranks_decode_as_one(path)


@pytest.mark.parametrize(
    "config, words",
    [
        (dict(bits=8), "bits=8"),
        (dict(desc_act=True), "desc_act"),
        (dict(group_size=48), "group_size 48"),
        (dict(quant_method="bitsandbytes"), "quant_method 'bitsandbytes'"),
        (dict(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    ],
)
def test_an_unsupported_config_is_refused_by_its_field(checkpoints, tmp_path, config, words):
    path, _ = quantized_checkpoint(checkpoints["gqa"], tmp_path / "m", "gptq", **config)
    with pytest.raises(ValueError, match=words):
        LLM(str(path), device="cpu")


def test_act_order_groups_and_a_mismatched_method_are_refused(checkpoints, tmp_path):
    path, _ = quantized_checkpoint(checkpoints["gqa"], tmp_path / "m", "gptq")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()  # the groups permuted: act-order
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj: g_idx"):
        LLM(str(path), device="cpu")
    with pytest.raises(ValueError, match="quantized with gptq; quantization='int8'"):
        LLM(str(path), device="cpu", quantization="int8")
    with pytest.raises(ValueError, match="quantization='awq' needs a checkpoint"):
        LLM(str(checkpoints["gqa"]), device="cpu", quantization="awq")


def test_quantized_moe_experts_are_refused_by_name(families, tmp_path):
    path, _ = quantized_checkpoint(families["qwen3_moe"], tmp_path / "m", "gptq")
    with pytest.raises(ValueError, match=r"experts\.0\.up_proj.*FusedMoE's weights cannot"):
        LLM(str(path), device="cpu")
