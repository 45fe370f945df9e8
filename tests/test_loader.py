"""Checkpoint loading: every tensor must find a parameter and every shape must match;
otherwise a ValueError names the tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM


def edited_checkpoint(src, dst, edit) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_missing_tensor_is_named(checkpoints, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = edited_checkpoint(checkpoints["gqa"], tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        LLM(path, num_kvcache_blocks=4)


def test_extra_tensor_is_named(checkpoints, tmp_path):
    def add(t):
        t["model.layers.0.mlp.surprise.weight"] = torch.zeros(2, 2)

    path = edited_checkpoint(checkpoints["gqa"], tmp_path / "m", add)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.surprise\.weight"):
        LLM(path, num_kvcache_blocks=4)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.norm.weight",
        "model.embed_tokens.weight",
    ],
)
def test_wrong_shape_is_named(checkpoints, tmp_path, name):
    def shrink(t):
        t[name] = t[name][:-1].clone()

    path = edited_checkpoint(checkpoints["gqa"], tmp_path / "m", shrink)
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*shape"):
        LLM(path, num_kvcache_blocks=4)


def test_tied_checkpoint_loads_without_lm_head(checkpoints):
    assert "lm_head.weight" not in load_file(checkpoints["mqa"] / "model.safetensors")
    with LLM(str(checkpoints["mqa"]), num_kvcache_blocks=4) as llm:
        model = llm.model_runner.model
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dummy_weights_need_only_config_json(checkpoints, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoints["gqa"] / name, tmp_path / name)
    with LLM(str(tmp_path), load_format="dummy", num_kvcache_blocks=8) as llm:
        out = llm.generate([[1, 2, 3]], use_tqdm=False)
        assert len(out[0]["token_ids"]) >= 1
        assert llm.model_runner.model.model.norm.weight.eq(1).all()


def test_dummy_weights_are_random_matrices_of_the_configs_std_unit_norms_and_zero_biases(
    checkpoints, tmp_path
):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoints["mqa"] / name, tmp_path / name)  # mqa: attention biases
    std = json.loads((tmp_path / "config.json").read_text())["initializer_range"]
    assert std != 0.02  # not the fallback, so the config's value must have been read
    with LLM(str(tmp_path), load_format="dummy", num_kvcache_blocks=8) as llm:
        params = dict(llm.model_runner.model.named_parameters())
    kinds = {"norm": 0, "bias": 0, "matrix": 0}
    for name, param in params.items():
        if name.endswith("norm.weight"):
            kinds["norm"] += 1
            assert param.eq(1).all(), name
        elif name.endswith("bias"):
            kinds["bias"] += 1
            assert param.eq(0).all(), name
        else:
            kinds["matrix"] += 1
            assert param.dim() == 2 and param.numel() >= 4096, name
            assert abs(param.std().item() / std - 1) < 0.05, f"{name}: std {param.std().item():.4f}"
            assert abs(param.mean().item()) < 0.05 * std, name
    # per layer 4 norms, 4 matrices, qkv and o biases; the final norm; the embedding (tied)
    assert kinds == {"norm": 9, "bias": 4, "matrix": 9}
    # each matrix drawn on its own, not one draw repeated
    first, second = (params[f"model.layers.{i}.mlp.down_proj.weight"] for i in (0, 1))
    assert not torch.equal(first, second)


def test_unsupported_architecture_lists_the_supported_ones(checkpoints, tmp_path):
    shutil.copytree(checkpoints["gqa"], tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    config.write_text(config.read_text().replace("Qwen3ForCausalLM", "GPT2LMHeadModel"))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(tmp_path / "m"), num_kvcache_blocks=4)
