"""Loading a checkpoint whose linear weights are stored in 4 bits (GPTQ, AWQ: published.py;
GGUF: gguf_checkpoint.py): each of the model's tensors comes from a reader as a float tensor or
as Int4Tensors, a layer's

    q [N, K] uint8 in 0..15,  scale [N, G],  offset [N, G] float32    w = scale * q + offset

per group of `group_size` inputs (int4.py's Int4Weight), in one of kernels/cpu_int4.py's forms:
SUB_SCALED adds sub_scale and sub_offset [N, K / 32] (0..63), w = scale sub_scale q + offset
sub_offset. Every tensor goes through its parameter's own weight_loader: q into the float weight
(0..15 are exact in any dtype), the others into float32 tensors of the weight's rows and one
column a group (or sub-block), so tensor parallelism and the fused q|k|v and gate|up layers
shard them as they shard a float weight (a SUB_SCALED group this rank's inputs do not hold
whole is read as AFFINE groups of 32). Then each such layer reads Int4Weight and its float
weight is freed.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from nanovllm.kernels import cpu_int4
from nanovllm.layers.linear import FormattedWeight, default_weight_loader


class Int4Tensors(NamedTuple):
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int
    form: cpu_int4.Form = cpu_int4.Form.AFFINE
    sub_scale: torch.Tensor | None = None  # SUB_SCALED's, [N, K / 32] in 0..63
    sub_offset: torch.Tensor | None = None


class _Side(NamedTuple):
    """A layer's tensors beside q, this rank's shards, filled part by part."""

    tensors: tuple[torch.Tensor, ...]  # scale, offset (and sub_scale, sub_offset) float32
    group_size: int
    form: cpu_int4.Form


Reader = Callable[[str], "torch.Tensor | Int4Tensors"]  # checkpoint tensor name -> its value


def load_layers(model: nn.Module, expected: dict[str, tuple[str, object]], read: Reader) -> int:
    """Every `expected` tensor (checkpoint name -> (parameter, shard id), models/loader.py's)
    read and loaded; how many layers read Int4Weight. A ValueError names each tensor that does
    not fit."""
    from nanovllm.quantization.int4 import Int4Weight

    params = dict(model.named_parameters())
    errors, side = [], {}  # parameter -> _Side
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
            value = _whole_groups(value, param.shape[1])
            layer = side.setdefault(param_name, _new_side(param, value))
            if (layer.group_size, layer.form) != (value.group_size, value.form):
                raise ValueError(
                    f"groups of {value.group_size} ({value.form.name}), the layer's others "
                    f"{layer.group_size} ({layer.form.name})"
                )
            parts = (value.scale, value.offset, value.sub_scale, value.sub_offset)
            for tensor, part in zip(layer.tensors, parts):
                loader(tensor, part.float(), shard_id)
        except (ValueError, KeyError) as e:
            errors.append(f"checkpoint tensor {name!r}: {e}")
    if errors:
        raise ValueError("\n".join(errors))
    for param_name, layer in side.items():
        module = model.get_submodule(param_name.rpartition(".")[0])
        q = params[param_name].detach().to(torch.uint8)
        scale, offset, *subs = layer.tensors
        subs = [t.to(torch.uint8) for t in subs]  # 0..63, exact in float32
        weight = Int4Weight(q, scale, offset, layer.group_size, layer.form, *subs)
        module.set_weight_format(weight, keep_weight=False)
    return len(side)


def _new_side(param: torch.Tensor, value: Int4Tensors) -> _Side:
    groups = _groups(param.shape[1], value.group_size)
    tensors = (_side(param, groups), _side(param, groups))
    if value.form == cpu_int4.Form.SUB_SCALED:
        subs = _groups(param.shape[1], cpu_int4.SUB)
        tensors += (_side(param, subs), _side(param, subs))
    return _Side(tensors, value.group_size, value.form)


def _whole_groups(value: Int4Tensors, in_features: int) -> Int4Tensors:
    """SUB_SCALED groups that this rank's inputs do not hold whole (tensor parallelism splits
    Q4_K's 256: down_proj's 3072 inputs over 8 ranks) as AFFINE groups of 32: scale sc and offset
    m, exact for a file's float16 scales and 6-bit sc and m."""
    if value.form != cpu_int4.Form.SUB_SCALED or in_features % value.group_size == 0:
        return value
    per_sub = value.group_size // cpu_int4.SUB
    scale = value.scale.repeat_interleave(per_sub, dim=1) * value.sub_scale.float()
    offset = value.offset.repeat_interleave(per_sub, dim=1) * value.sub_offset.float()
    return Int4Tensors(value.q, scale, offset, cpu_int4.SUB)


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
