"""A PEFT LoRA checkpoint read as PEFT writes it: adapter_config.json and
adapter_model.safetensors, tensors named

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight    A [r, in]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight    B [out, r]

for each targeted projection (q, k, v, o, gate, up, down), so that the layer computes
W x + scale * B (A x), scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). The scale is
folded into B here. What PEFT can write but this engine does not run is refused by name: DoRA,
trained biases, modules_to_save, per-module ranks or alphas, embedding or LM-head targets."""

import json
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
from safetensors.torch import load_file

from nanovllm.lora.request import LoRARequest

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAWeights(NamedTuple):
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], the scale folded in


@dataclass(frozen=True)
class Adapter:
    request: LoRARequest
    rank: int
    weights: dict[str, LoRAWeights]  # the checkpoint's module name -> its A and B


def read_adapter(request: LoRARequest, max_rank: int) -> Adapter:
    """The adapter at request.lora_path, checked; a ValueError naming what is wrong."""
    path = os.path.expanduser(request.lora_path)
    config = _read_config(path, request.lora_name)
    scale_of = _scaling(config)
    try:
        tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    except Exception as e:  # safetensors' own error type: a file cut short, not safetensors
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {WEIGHTS_FILE}: {e}") from None
    pairs = _pairs(tensors, request.lora_name)
    rank = max(a.shape[0] for a, _ in pairs.values())
    if rank > max_rank:
        raise ValueError(
            f"LoRA adapter {request.lora_name!r} has rank {rank}, above max_lora_rank="
            f"{max_rank}; raise max_lora_rank"
        )
    weights = {name: LoRAWeights(a, b * scale_of(a.shape[0])) for name, (a, b) in pairs.items()}
    return Adapter(request, rank, weights)


def _read_config(path: str, name: str) -> dict:
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, file)):
            raise ValueError(
                f"LoRA adapter {name!r}: no {file} in {path!r} (a PEFT checkpoint saved with "
                f"safetensors, as PeftModel.save_pretrained writes it)"
            )
    with open(os.path.join(path, CONFIG_FILE)) as f:
        try:
            config = json.load(f)
        except ValueError as e:
            raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    refused = {
        "peft_type": config.get("peft_type", "LORA") not in ("LORA", None),
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") not in ("none", None),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "layers_to_transform": config.get("layers_to_transform") is not None,
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),  # Conv1D bases (GPT-2) only
    }
    if bad := [key for key, is_bad in refused.items() if is_bad]:
        raise ValueError(
            f"LoRA adapter {name!r}: {', '.join(f'{k}={config.get(k)!r}' for k in bad)} is not "
            f"supported (a plain LoRA of q/k/v/o/gate/up/down projections is)"
        )
    return config


def _scaling(config: dict):
    alpha = config.get("lora_alpha", config.get("r", 8))
    if config.get("use_rslora"):
        return lambda r: alpha / math.sqrt(r)
    return lambda r: alpha / r


def _pairs(tensors: dict[str, torch.Tensor], name: str) -> dict[str, tuple]:
    """module name (model.layers.3.self_attn.q_proj) -> (A, B), every tensor accounted for."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight") or module.rsplit(".", 1)[-1] not in TARGETS:
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key!r} is not the lora_A or lora_B weight of "
                f"a supported target ({', '.join(TARGETS)})"
            )
        parts.setdefault(module, {})[kind[0]] = tensor
    if not parts:
        raise ValueError(f"LoRA adapter {name!r} holds no LoRA tensors")
    pairs = {}
    for module, ab in parts.items():
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"LoRA adapter {name!r}: {module} needs lora_A [r, in] and lora_B [out, r]; "
                f"got {_shape(a)} and {_shape(b)}"
            )
        pairs[module] = (a, b)
    return pairs


def _shape(t: torch.Tensor | None) -> str:
    return "none" if t is None else str(list(t.shape))
