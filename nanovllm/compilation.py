"""torch.compile for the small ops between the matmuls (RMSNorm + residual, SiluAndMul, rotary,
the sampler's softmax race), on CUDA without enforce_eager (on a CPU compiling costs 10-25 s a
process, more than it saves: benchmarks/compiled_ops.py). Each op is compiled once per process
and shared by every layer: dynamo guards on shapes and dtypes, never on a layer."""

import functools
from collections.abc import Callable

import torch

from nanovllm.utils import Scoped

_enabled: Scoped[bool] = Scoped(False)
compile_scope = _enabled.scope  # layers (and samplers) built inside use the compiled ops


class HotOp:
    """A pure function (`@HotOp`), its compiled twin (made on first demand) and, given one by
    hot_op, a native twin that CPU layers call instead."""

    def __init__(self, fn: Callable, native: Callable | None = None):
        self.eager, self.native = fn, native
        self._compiled: Callable | None = None

    def select(self) -> Callable:
        """For a layer being built: compiled in compile_scope(True), else native on a CPU."""
        if _enabled.value:
            self._compiled = self._compiled or torch.compile(self.eager)
            return self._compiled
        on_cpu = torch.get_default_device().type == "cpu"
        return self.native if self.native and on_cpu else self.eager


def hot_op(native: Callable) -> Callable[[Callable], HotOp]:
    """`@hot_op(native=twin)` on an eager op: a HotOp whose CPU layers call twin(eager, *args)
    (the twins of kernels/cpu_ops.py fall back to the eager op for what they do not cover)."""
    return lambda eager: HotOp(eager, functools.partial(native, eager))
