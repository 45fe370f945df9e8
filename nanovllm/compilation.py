"""Hot ops: the small pure functions between the matmuls (RMSNorm + residual, SiLU-and-mul, rotary,
the sampler's draw, an MoE layer's experts). A layer takes its op's implementation once, when it
is built (`op.select()`), and the platform in charge chooses which (`ops_scope(choice)` around
the model's construction):

    eager_ops      the plain PyTorch function (the default; what the tests hold as the reference)
    compiled_ops   torch.compile's twin, made once per process and shared by every layer (dynamo
                   guards on shapes and dtypes, never on a layer): CUDA, without enforce_eager
    a platform's   its own table, e.g. a CPU's native twins (platforms/cpu/ops.py)

On a CPU compiling costs 10-25 s a process, more than it saves (docs/benchmarks.md)."""

from collections.abc import Callable

import torch

from nanovllm.utils import Scoped


class HotOp:
    """A pure function (`@HotOp`) and its compiled twin, made on first demand. Called directly,
    it is the eager function; `name` is the function's. `@HotOp.uncompiled`: one op that
    torch.compile has nothing to fuse into, whose compiled twin is itself (a platform may still
    have a native one)."""

    def __init__(self, fn: Callable, compiles: bool = True):
        self.eager, self.name = fn, fn.__name__
        self.compiles = compiles
        self._compiled: Callable | None = None

    @classmethod
    def uncompiled(cls, fn: Callable) -> "HotOp":
        return cls(fn, compiles=False)

    def __call__(self, *args, **kwargs):
        return self.eager(*args, **kwargs)

    def compiled(self) -> Callable:
        if not self.compiles:
            return self.eager
        self._compiled = self._compiled or torch.compile(self.eager)
        return self._compiled

    def select(self) -> Callable:
        """For a layer being built: what the current ops_scope chooses for this op."""
        return _choice.value(self)


OpChoice = Callable[[HotOp], Callable]  # a platform's rule: an op -> its implementation


def eager_ops(op: HotOp) -> Callable:
    return op.eager


def compiled_ops(op: HotOp) -> Callable:
    return op.compiled()


_choice: Scoped[OpChoice] = Scoped(eager_ops)
ops_scope = _choice.scope  # layers (and samplers) built inside take their hot ops by its choice
