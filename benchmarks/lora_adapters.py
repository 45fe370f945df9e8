"""Random LoRA adapters for a checkpoint's config.json, written as PEFT saves them
(adapter_config.json, adapter_model.safetensors with PEFT's tensor names), so that bench.py can
run a workload whose requests name different adapters without PEFT or a download."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(c: dict) -> dict[str, tuple[int, int]]:
    """Each target's (in_features, out_features) in a dense decoder layer."""
    hidden, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    q, kv, inter = heads * head_dim, kv_heads * head_dim, c["intermediate_size"]
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_random_adapter(config: dict, path: Path, rank: int, seed: int) -> Path:
    """A rank-`rank` LoRA of every target of every layer, small random weights."""
    g = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if target in attention else "mlp"
            name = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in**-0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return path
