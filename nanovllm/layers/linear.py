"""Linear layers sharded over the tensor-parallel group current when they are built; each
parameter's `weight_loader(param, loaded, shard_id=None)` copies its shard of the checkpoint.

    ColumnParallelLinear   y = x W^T, W split by output rows: each rank has out/N rows
    RowParallelLinear      W split by input columns; partial sums are all-reduced
    Merged/QKV variants    several checkpoint tensors packed into one column-parallel W

After loading, a platform or a quantization may give a layer a WeightFormat, which its GEMM
then reads instead of the float weight.
"""

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.group import TPGroup, get_tp_group


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


class WeightFormat(Protocol):
    """A linear layer's weight in another form than its float tensor, and the GEMM that reads
    it: given to the layer after loading by the platform (a CPU's oneDNN-packed copy,
    platforms/cpu/weights.py) or by quantization (int8, int4: quantization/). A CPU format may
    also hand the native decode step what it reads (`native_linear(bias)`,
    platforms/cpu/decode_step.py); without it the step is not used."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias), W as this format holds it."""
        ...


class FormattedWeight:
    """A layer whose GEMM may read its weight through a WeightFormat (None: F.linear)."""

    weight_format: WeightFormat | None = None

    def set_weight_format(
        self, weight_format: WeightFormat | None, keep_weight: bool = True
    ) -> None:
        """Read the weight through `weight_format` from now on; `keep_weight=False` frees the
        float weight, which the format must then not need."""
        self.weight_format = weight_format
        if not keep_weight:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_format is not None:
            return self.weight_format.linear(x, bias)
        return F.linear(x, self.weight, bias)


class LinearBase(FormattedWeight, nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank, self.tp_group.size
        self.input_size, self.output_size = input_size, output_size  # this rank's
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    weight_loader = staticmethod(default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


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
        y = self.linear(x, self.bias if self.tp_rank == 0 else None)
        return self.tp_group.all_reduce(y)
