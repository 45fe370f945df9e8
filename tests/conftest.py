"""Shared fixtures: small random Qwen3 checkpoints built offline once per test run,
and Hugging Face `transformers` as the oracle for their output."""
from functools import lru_cache
from pathlib import Path

import pytest

# name -> build_tiny_qwen3 arguments. Both GQA and MQA; tied and untied LM head;
# with and without attention bias; head_dim * heads != hidden_size in "mqa".
MODEL_SHAPES = {
    "gqa": dict(num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False),
    "mqa": dict(num_heads=4, num_kv_heads=1, head_dim=32, tie_word_embeddings=True,
                attention_bias=True, seed=1),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> checkpoint directory, including "gqa_v4": the gqa model with a
    transformers-4 style config.json (rope_theta, torch_dtype)."""
    from nanovllm.models.demo import build_tiny_qwen3

    root = tmp_path_factory.mktemp("checkpoints")
    paths = {name: build_tiny_qwen3(root / name, **kw) for name, kw in MODEL_SHAPES.items()}
    paths["gqa_v4"] = build_tiny_qwen3(root / "gqa_v4", config_style="transformers4",
                                       **MODEL_SHAPES["gqa"])
    return paths


@lru_cache(maxsize=None)
def hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # No EOS for generate(): it runs the full length, as ignore_eos=True does on our side.
    # (min_new_tokens would instead mask EOS out of the argmax and change the tokens.)
    model.generation_config.eos_token_id = None
    return model


@lru_cache(maxsize=None)
def hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, one prompt at a time (no padding)."""
    import torch

    out = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + max_new_tokens
    return out[0, len(prompt):].tolist()
