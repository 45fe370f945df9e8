"""A LoRA layer: a target projection's WeightFormat (layers/linear.py) that computes the layer's
own GEMM (through the format it had: a CPU's packed copy, int8, or F.linear) and adds each row's
adapter (ops.py), reading the step's rows from the ForwardContext. It holds every slot's A and B
stacked, each slice of a merged projection (q | k | v, gate | up) in its own R columns:

    a [slots, S * R, in]    b [slots, S * R, out]   (B transposed: a row's update streams along out)

Tensor parallelism splits them as the layer's weight: a column-parallel layer's B by its output
rows (each slice's rows of this rank), a row-parallel layer's A by its input columns, whose
partial products the layer's all-reduce then sums with its own."""

import torch
import torch.nn.functional as F

from nanovllm.attention.metadata import get_context
from nanovllm.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear
from nanovllm.lora.checkpoint import LoRAWeights
from nanovllm.lora.ops import lora_delta


class LoRALayer:
    def __init__(self, layer: LinearBase, num_slots: int, max_rank: int):
        self.base, self.weight = layer.weight_format, layer.weight  # the layer's own GEMM
        self.row_parallel = isinstance(layer, RowParallelLinear)
        self.tp_rank, self.tp_size = layer.tp_rank, layer.tp_size
        tp = layer.tp_size
        if isinstance(layer, MergedColumnParallelLinear):
            self.slice_sizes = [size // tp for size in layer.output_sizes]  # this rank's rows
        else:
            self.slice_sizes = [layer.output_size]
        # what a checkpoint's A and B must be: [r, in] and [out of its slice, r], whole
        self.in_features = layer.input_size * (tp if self.row_parallel else 1)
        self.slice_out = [size * (1 if self.row_parallel else tp) for size in self.slice_sizes]
        self.rank = max_rank
        self.slice_ends = torch.tensor(self.slice_sizes).cumsum(0)  # on the host, for the C++
        width = len(self.slice_sizes) * max_rank
        options = dict(dtype=layer.weight.dtype, device=layer.weight.device)
        self.a = torch.zeros(num_slots, width, layer.input_size, **options)
        self.b = torch.zeros(num_slots, width, layer.output_size, **options)
        self._delta = lora_delta.select()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.base.linear(x, bias) if self.base is not None else F.linear(x, self.weight, bias)
        mapping = get_context().lora
        if mapping is None:
            return y
        # x, y: [rows, in], [rows, out]
        return self._delta(y, x, self.a, self.b, mapping, self.slice_ends)

    def check(self, j: int, weights: LoRAWeights, where: str) -> None:
        """A ValueError unless slice j's A and B fit this layer's shape."""
        (r, in_features), out_features = weights.a.shape, weights.b.shape[0]
        if in_features != self.in_features or out_features != self.slice_out[j]:
            raise ValueError(
                f"{where}: lora_A [{r}, {in_features}] and lora_B [{out_features}, {r}] do not "
                f"fit the base model's layer ({self.in_features} in, {self.slice_out[j]} out); "
                f"was the adapter trained on another model?"
            )

    def load(self, slot: int, slices: list[LoRAWeights | None]) -> None:
        """Slot `slot` holds these slices' weights (None: the slice has no adapter)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        offset = 0
        for j, (weights, size) in enumerate(zip(slices, self.slice_sizes)):
            if weights is not None:
                a, b = self._shard(weights, size)
                columns = slice(j * self.rank, j * self.rank + a.shape[0])
                self.a[slot, columns] = a
                self.b[slot, columns, offset : offset + size] = b.T
            offset += size

    def _shard(self, weights: LoRAWeights, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A and B of one slice (`size`: its rows here)."""
        a, b = weights
        if self.row_parallel:
            columns = a.shape[1] // self.tp_size
            return a[:, self.tp_rank * columns : (self.tp_rank + 1) * columns], b
        return a, b[self.tp_rank * size : (self.tp_rank + 1) * size]
