"""torch.compile for the small ops between the matmuls (RMSNorm + residual, SiluAndMul, rotary,
the sampler's softmax race), on CUDA without enforce_eager (on a CPU compiling costs 10-25 s a
process, more than it saves: benchmarks/compiled_ops.py). Each op is compiled once per process
and shared by every layer: dynamo guards on shapes and dtypes, never on a layer."""
from collections.abc import Callable

import torch

from nanovllm.utils import Scoped

_enabled: Scoped[bool] = Scoped(False)
compile_scope = _enabled.scope  # layers (and samplers) built inside use the compiled ops


class HotOp:
    """A pure function (`@HotOp`) and, made on first demand, its torch.compile'd twin."""

    def __init__(self, fn: Callable):
        self.eager = fn
        self._compiled: Callable | None = None

    def select(self) -> Callable:
        """For a layer being built: the compiled twin inside compile_scope(True), else eager."""
        if not _enabled.value:
            return self.eager
        if self._compiled is None:
            self._compiled = torch.compile(self.eager)
        return self._compiled
