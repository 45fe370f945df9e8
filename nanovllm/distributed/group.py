"""The tensor-parallel group a model is sharded over.

Every engine has a group of its own (two engines may live in one process), so layers never use
torch.distributed's global group: a layer takes the group current while it is built
(`with tp_group_scope(group): model = ...`) and keeps it. Outside a scope the group is a single
rank, whose collectives have nothing to do; several ranks' are distributed/collectives.py's.
"""

from dataclasses import dataclass

import torch

from nanovllm.utils import Scoped


@dataclass(slots=True)
class TPGroup:
    """This rank's place in its engine's tensor-parallel group, shared by all its layers."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place across ranks; returns `x`. `op`: "sum" or "min"."""
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` concatenated along the last dim, on rank 0; None elsewhere."""
        return x

    def shutdown(self) -> None:
        """Release the backend; no collective after."""


SINGLE_RANK = TPGroup()
_current: Scoped[TPGroup] = Scoped(SINGLE_RANK)
tp_group_scope = _current.scope  # layers constructed inside shard over the group


def get_tp_group() -> TPGroup:
    return _current.value
