"""Checkpoint loading: every tensor must find a parameter and every shape must match;
otherwise a ValueError names the tensor."""
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


@pytest.mark.parametrize("name", ["model.layers.0.mlp.up_proj.weight",
                                  "model.layers.0.self_attn.o_proj.weight",
                                  "model.norm.weight", "model.embed_tokens.weight"])
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


def test_unsupported_architecture_lists_the_supported_ones(checkpoints, tmp_path):
    shutil.copytree(checkpoints["gqa"], tmp_path / "m")
    config = (tmp_path / "m" / "config.json")
    config.write_text(config.read_text().replace("Qwen3ForCausalLM", "GPT2LMHeadModel"))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(tmp_path / "m"), num_kvcache_blocks=4)
