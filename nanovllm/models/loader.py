"""Checkpoint -> parameters. Each parameter's `weight_loader` takes its own shard; this
module only maps checkpoint names onto parameters and checks that everything matched:
every checkpoint tensor found a parameter, every parameter got all its tensors, every
shape fit. A mismatch is one ValueError naming each tensor concerned.

A checkpoint is one model.safetensors or, as large ones are published, several files
listed by model.safetensors.index.json (then only the files it lists are read).

Checkpoint names map onto parameter names through the model's mappings:
    packed_modules_mapping  q_proj -> (qkv_proj, "q"): several tensors, one parameter
    expert_params_mapping   (experts.w13_, experts.7.up_proj., (7, "w3")): one tensor per
                            expert and projection, one parameter for all experts (MoE)
"""

import glob
import json
import os
from collections import defaultdict

from safetensors import safe_open
from torch import nn

from nanovllm.layers.linear import default_weight_loader

INDEX_FILE = "model.safetensors.index.json"
# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(model: nn.Module, path: str) -> None:
    params = dict(model.named_parameters())
    expected = expected_tensors(model, params)
    found = checkpoint_tensors(path)
    check_names(model, path, expected, found)
    errors = []
    for file, names in _by_file(found, expected).items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                param_name, shard_id = expected[name]
                param = params[param_name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    loader(param, f.get_tensor(name), shard_id)
                except ValueError as e:
                    errors.append(f"checkpoint tensor {name!r}: {e}")
    if errors:
        raise ValueError("\n".join(errors))


def expected_tensors(model: nn.Module, params: dict) -> dict[str, tuple[str, object]]:
    """Checkpoint tensor name -> (parameter name, shard id) for everything the model needs."""
    packed = [
        (param_part, checkpoint_part, shard_id)
        for checkpoint_part, (param_part, shard_id) in getattr(
            model, "packed_modules_mapping", {}
        ).items()
    ]
    experts = getattr(model, "expert_params_mapping", [])
    expected = {}
    for param_name in params:
        rewrites = _rewrites(param_name, experts, ".{}") or _rewrites(param_name, packed, ".{}.")
        if not rewrites:
            expected[param_name] = (param_name, None)  # stored under its own name
        for param_part, checkpoint_part, shard_id in rewrites:
            expected[param_name.replace(param_part, checkpoint_part, 1)] = (param_name, shard_id)
    return expected


def _rewrites(param_name: str, mappings: list, pattern: str) -> list[tuple[str, str, object]]:
    """The mappings whose parameter part (dotted as `pattern` says) is in param_name."""
    return [
        (pattern.format(p), pattern.format(c), s)
        for p, c, s in mappings
        if pattern.format(p) in param_name
    ]


def checkpoint_files(path: str) -> list[str]:
    """The files the index lists, or every *.safetensors file when there is no index."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index!r} has no weight_map")
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        absent = [os.path.basename(file) for file in files if not os.path.isfile(file)]
        if absent:
            raise ValueError(
                f"{INDEX_FILE} in {path!r} lists file(s) that are missing: {', '.join(absent)}"
            )
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(
            f"no *.safetensors files in {path!r}; use load_format='dummy' for random weights"
        )
    return files


def checkpoint_tensors(path: str) -> dict[str, str]:
    """Tensor name -> the file holding it (the recomputed buffers left out)."""
    found = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            found.update((name, file) for name in f.keys() if not name.endswith(_IGNORED_SUFFIXES))
    return found


def check_names(model: nn.Module, path: str, expected: dict, found: dict) -> None:
    """Before a tensor is read: every missing and every extra tensor, by name."""
    extra = sorted(
        name
        for name in found.keys() - expected.keys()
        if not (name == "lm_head.weight" and _is_tied(model))
    )  # stored twice: fine
    missing = sorted(expected.keys() - found.keys())
    problems = []
    if missing:
        problems.append(f"checkpoint {path!r} lacks tensor(s): {', '.join(missing)}")
    if extra:
        problems.append(
            f"checkpoint tensor(s) {', '.join(map(repr, extra))} match no "
            f"parameter of {type(model).__name__}"
        )
    if problems:
        raise ValueError("\n".join(problems))


def _by_file(found: dict, expected: dict) -> dict[str, list[str]]:
    names = defaultdict(list)
    for name in expected:
        names[found[name]].append(name)
    return names


def _is_tied(model: nn.Module) -> bool:
    lm_head = getattr(model, "lm_head", None)
    embed = model.get_submodule("model.embed_tokens") if hasattr(model, "model") else None
    return lm_head is not None and embed is not None and lm_head.weight is embed.weight
