"""Linear layers that shard over tensor-parallel ranks (Megatron style).

    ColumnParallelLinear   y = x W^T, W split by output rows: each rank has out/N rows
    RowParallelLinear      W split by input columns; partial sums are all-reduced
    Merged/QKV variants    several checkpoint tensors packed into one column-parallel W

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that
copies its own shard out of the full checkpoint tensor, so the loader stays a loop.
A layer shards over the tensor-parallel group current when it is built (parallel_state).
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.group import get_tp_group


def divide(numerator: int, denominator: int) -> int:
    """A sharded size; Config checked that tensor_parallel_size divides the model's."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    copy_checked(param, loaded)


class LinearBase(nn.Module):
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
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """The full weight on every rank (e.g. an MoE router)."""


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_group().size), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param, self._rank_slice(loaded, param.shape[0]))

    def _rank_slice(self, loaded: torch.Tensor, shard_size: int) -> torch.Tensor:
        if loaded.shape[0] != shard_size * self.tp_size:
            raise ValueError(f"shape {tuple(loaded.shape)} has {loaded.shape[0]} output rows, "
                             f"expected {shard_size * self.tp_size}")
        return loaded.narrow(0, self.tp_rank * shard_size, shard_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs side by side (gate_proj | up_proj); shard_id is
    the index of the checkpoint tensor."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        # Each part is sharded on its own, so each (not just the sum) must divide.
        assert all(size % get_tp_group().size == 0 for size in output_sizes), output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        copy_checked(param.data.narrow(0, offset, size), self._rank_slice(loaded, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q | k | v projections in one matrix; each rank holds its heads of each."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False):
        tp_size = get_tp_group().size
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = divide(total_num_kv_heads, tp_size)
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size),
                        "v": (q_size + kv_size, kv_size)}[shard_id]
        copy_checked(param.data.narrow(0, offset, size), self._rank_slice(loaded, size))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_group().size), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is not sharded: every rank holds all of it
            copy_checked(param, loaded)
            return
        shard = param.shape[1]
        if loaded.dim() != 2 or loaded.shape[1] != shard * self.tp_size:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected "
                             f"({param.shape[0]}, {shard * self.tp_size})")
        copy_checked(param, loaded.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, by rank 0, not once per rank by the all-reduce.
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return self.tp_group.all_reduce(y)
