"""Checkpoint -> parameters. Each parameter's `weight_loader` takes its own shard; this
module only maps checkpoint names onto parameters and checks that everything matched:
every checkpoint tensor found a parameter, every parameter got all its tensors."""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.layers.linear import default_weight_loader

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(model: nn.Module, path: str) -> None:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}; use load_format='dummy' for "
                         "random weights")
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    expected = _expected_tensors(params, packed)
    loaded: set[tuple[str, object]] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                target = _target(name, packed, params, model)
                if target is None:
                    continue
                param_name, shard_id = target
                param = params[param_name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    loader(param, f.get_tensor(name), shard_id)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
                loaded.add(target)
    missing = sorted(expected[t] for t in expected.keys() - loaded)
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks tensor(s): {', '.join(missing)}")


def _target(name: str, packed: dict, params: dict, model: nn.Module) -> tuple[str, object] | None:
    """(parameter name, shard id) for a checkpoint tensor; None for one to skip."""
    for checkpoint_part, (param_part, shard_id) in packed.items():
        if f".{checkpoint_part}." in name:
            param_name = name.replace(f".{checkpoint_part}.", f".{param_part}.")
            if param_name in params:
                return param_name, shard_id
            break
    if name in params:
        return name, None
    if name == "lm_head.weight" and _is_tied(model):
        return None  # some tied checkpoints store the shared matrix twice
    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")


def _expected_tensors(params: dict, packed: dict) -> dict[tuple[str, object], str]:
    """(parameter name, shard id) -> the checkpoint tensor name that should fill it."""
    expected = {}
    for param_name in params:
        shards = [(part, sid) for part, (p, sid) in packed.items() if f".{p}." in param_name]
        if not shards:
            expected[(param_name, None)] = param_name
        for checkpoint_part, shard_id in shards:
            packed_part = packed[checkpoint_part][0]
            expected[(param_name, shard_id)] = param_name.replace(f".{packed_part}.",
                                                                  f".{checkpoint_part}.")
    return expected


def _is_tied(model: nn.Module) -> bool:
    lm_head = getattr(model, "lm_head", None)
    embed = model.get_submodule("model.embed_tokens") if hasattr(model, "model") else None
    return lm_head is not None and embed is not None and lm_head.weight is embed.weight


@torch.no_grad()
def load_dummy_weights(model: nn.Module, initializer_range: float = 0.02, seed: int = 0) -> None:
    """Random weights from the config alone (vLLM's load_format='dummy'): norms are 1,
    biases 0, other matrices N(0, initializer_range)."""
    generator = None
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            if generator is None:
                generator = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, initializer_range, generator=generator)
