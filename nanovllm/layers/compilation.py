"""torch.compile for the small ops between the matmuls: RMSNorm (with its residual add),
SiluAndMul, the rotary embedding and the sampler's softmax race. Eagerly each is several
kernels, each a round trip through memory; compiled, one fused kernel. On CUDA only, and
not under enforce_eager. On a CPU compiled ops are faster per call from a few dozen tokens
on, but compiling costs each process 10-25 s, more than it saves on short runs and small
models such as the tests' (benchmarks/compiled_ops.py measures the ops).

A layer picks the eager or the compiled function when it is built, inside the scope the
model runner opens, as it picks its tensor-parallel group:

    with compile_scope(enabled=True):
        model = Qwen3ForCausalLM(hf_config)

Each op is a pure function of tensors (and a float such as eps), compiled once per
process and shared by every layer: dynamo guards on shapes and dtypes, never on a layer
instance, so 28 layers x 4 norms make one compiled RMSNorm, not 112.
"""
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_enabled = False


@contextmanager
def compile_scope(enabled: bool) -> Iterator[None]:
    """Layers (and samplers) constructed inside use the compiled ops when `enabled`."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


class HotOp:
    """A pure function and, made on first demand, its torch.compile'd twin."""

    def __init__(self, fn: Callable):
        self.eager = fn
        self._compiled: Callable | None = None

    def select(self) -> Callable:
        """For a layer being built: the compiled function inside compile_scope(True),
        else the eager one."""
        if not _enabled:
            return self.eager
        if self._compiled is None:
            self._compiled = torch.compile(self.eager)
        return self._compiled


def hot_op(fn: Callable) -> HotOp:
    """Decorator: mark a pure function as one the CUDA path compiles."""
    return HotOp(fn)
