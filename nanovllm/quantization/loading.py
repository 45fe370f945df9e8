"""Loading a checkpoint whose linear weights are stored in 4 bits (GPTQ, AWQ: published.py;
GGUF: gguf_checkpoint.py): each of the model's tensors comes from a reader as a float tensor or
as Int4Tensors, a layer's

    q [N, K] uint8 in 0..15,  scale [N, G],  offset [N, G] float32    w = scale * q + offset

per group of `group_size` inputs (int4.py's Int4Weight). Every tensor goes through its
parameter's own weight_loader: q into the float weight (0..15 are exact in any dtype), scale
and offset into tensors of the weight's rows and one column a group, so tensor parallelism and
the fused q|k|v and gate|up layers shard them as they shard a float weight. Then each such
layer reads Int4Weight and its float weight is freed.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from nanovllm.layers.linear import FormattedWeight, default_weight_loader


class Int4Tensors(NamedTuple):
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int


Reader = Callable[[str], "torch.Tensor | Int4Tensors"]  # checkpoint tensor name -> its value


def load_layers(model: nn.Module, expected: dict[str, tuple[str, object]], read: Reader) -> int:
    """Every `expected` tensor (checkpoint name -> (parameter, shard id), models/loader.py's)
    read and loaded; how many layers read Int4Weight. A ValueError names each tensor that does
    not fit."""
    from nanovllm.quantization.int4 import Int4Weight

    params = dict(model.named_parameters())
    errors, side = [], {}  # side: parameter -> (scale, offset, group size), this rank's shards
    for name, (param_name, shard_id) in expected.items():
        param = params[param_name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            value = read(name)
            if isinstance(value, torch.Tensor):
                loader(param, value, shard_id)
                continue
            module = model.get_submodule(param_name.rpartition(".")[0])
            if not isinstance(module, FormattedWeight):  # e.g. Qwen3-MoE's experts
                raise ValueError(
                    f"a {type(module).__name__}'s weights cannot load in 4 bits; only linear "
                    "layers' can"
                )
            loader(param, value.q.to(param.dtype), shard_id)
            groups = _groups(param.shape[1], value.group_size)
            scale, offset, group_size = side.setdefault(
                param_name, (_side(param, groups), _side(param, groups), value.group_size)
            )
            if group_size != value.group_size:
                raise ValueError(f"groups of {value.group_size}, the layer's others {group_size}")
            loader(scale, value.scale, shard_id)
            loader(offset, value.offset, shard_id)
        except (ValueError, KeyError) as e:
            errors.append(f"checkpoint tensor {name!r}: {e}")
    if errors:
        raise ValueError("\n".join(errors))
    for param_name, (scale, offset, group_size) in side.items():
        module = model.get_submodule(param_name.rpartition(".")[0])
        q = params[param_name].detach().to(torch.uint8)
        module.set_weight_format(Int4Weight(q, scale, offset, group_size), keep_weight=False)
    return len(side)


def _groups(in_features: int, group_size: int) -> int:
    """This rank's groups: its inputs must be whole groups."""
    if in_features % group_size:
        raise ValueError(
            f"this rank's {in_features} inputs are not whole groups of {group_size} "
            "(tensor_parallel_size splits a group)"
        )
    return in_features // group_size


def _side(param: torch.Tensor, groups: int) -> torch.Tensor:
    """A float32 tensor of the parameter's rows and one column a group."""
    return torch.empty(param.shape[0], groups, dtype=torch.float32)
