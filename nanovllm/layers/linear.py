"""Linear layers sharded over the tensor-parallel group current when they are built; each
parameter's `weight_loader(param, loaded, shard_id=None)` copies its shard of the checkpoint.

    ColumnParallelLinear   y = x W^T, W split by output rows: each rank has out/N rows
    RowParallelLinear      W split by input columns; partial sums are all-reduced
    Merged/QKV variants    several checkpoint tensors packed into one column-parallel W
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.group import TPGroup, get_tp_group
from nanovllm.kernels import cpu_step


def divide(numerator: int, denominator: int) -> int:
    """A sharded size; Config checked that tensor_parallel_size divides the model's."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy `loaded` into `param` (or a view of it), refusing another shape."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape {tuple(loaded.shape)} does not match the expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def rank_slice(loaded: torch.Tensor, dim: int, shard_size: int, group: TPGroup) -> torch.Tensor:
    """The rank's shard_size rows (dim 0) or columns (dim 1) of a checkpoint tensor."""
    if loaded.dim() <= dim or loaded.shape[dim] != shard_size * group.size:
        raise ValueError(
            f"shape {tuple(loaded.shape)} does not have the expected "
            f"{shard_size * group.size} {('rows', 'columns')[dim]}"
        )
    return loaded.narrow(dim, group.rank * shard_size, shard_size)


# Where a CPU linear's own GEMMs beat F.linear: docs/cpu.md#onednns-gemm-on-prepacked-weights.
PACKED_MAX_ROWS = 256
PACKED_MIN_WEIGHT = 2**16


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: object | None = None,
) -> torch.Tensor:
    """F.linear, or the layer's own GEMM over `packed`: a weight format's (int8, its `linear`:
    layers/quantization.py), or on a CPU a blocked copy's (pack_linear_weights; cpu_step.py)."""
    if packed is not None and not isinstance(packed, torch.Tensor):
        return packed.linear(x, bias)
    if packed is not None and x.dim() == 2 and x.shape[0] <= PACKED_MAX_ROWS:
        return cpu_step.packed_linear(x, weight, packed, bias)
    return F.linear(x, weight, bias)


def pack_linear_weights(model: nn.Module, undo: bool = False) -> int:
    """A CPU runner's choice: every linear (the LM head too) of at least PACKED_MIN_WEIGHT
    elements gets a copy of its weight in oneDNN's blocked layout, beside the weight itself
    (`undo`: drop the copies). Returns how many got one."""
    packed = 0
    for module in model.modules():
        if hasattr(module, "packed"):  # LinearBase and ParallelLMHead
            pack = not undo and module.weight.numel() >= PACKED_MIN_WEIGHT
            module.packed = (
                torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
                if pack
                else None
            )
            packed += pack
    return packed


class LinearBase(nn.Module):
    packed: torch.Tensor | None = None  # pack_linear_weights' copy, on a CPU

    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank, self.tp_group.size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    weight_loader = staticmethod(default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class ReplicatedLinear(LinearBase):
    """The full weight on every rank (e.g. an MoE router)."""


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_group().size), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, rank_slice(loaded, 0, param.shape[0], self.tp_group))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel outputs side by side (gate_proj | up_proj); shard_id: which one."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        # Each part is sharded on its own, so each (not just the sum) must divide.
        assert all(size % get_tp_group().size == 0 for size in output_sizes), output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        default_weight_loader(
            param.data.narrow(0, offset, size), rank_slice(loaded, 0, size, self.tp_group)
        )


class QKVParallelLinear(MergedColumnParallelLinear):
    """q | k | v projections in one matrix (shard ids "q", "k", "v"); each rank has its heads."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ):
        tp_size = get_tp_group().size
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = divide(total_num_kv_heads, tp_size)
        kv_size = total_num_kv_heads * head_dim
        super().__init__(hidden_size, [total_num_heads * head_dim, kv_size, kv_size], bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        super().weight_loader(param, loaded, "qkv".index(shard_id))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_group().size), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 2:  # the bias is not sharded: every rank holds all of it
            loaded = rank_slice(loaded, 1, param.shape[1], self.tp_group)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, by rank 0, not once per rank by the all-reduce.
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None, self.packed)
        return self.tp_group.all_reduce(y)
