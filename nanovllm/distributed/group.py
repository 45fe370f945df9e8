"""The tensor-parallel group a model is sharded over, and its collectives.

Every engine has a process group of its own (two engines may live in one process), so
layers never use torch.distributed's global group: a layer takes the group current while
it is built (`with tp_group_scope(group): model = ...`) and keeps it. Outside a scope the
group is a single rank. The collectives call the backend object itself: torch.distributed's
functions look ranks up in a registry our groups are not in.
"""

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.utils import Scoped

GROUP_TIMEOUT = timedelta(minutes=5)  # a collective waiting this long on a live rank fails


@dataclass(slots=True)
class TPGroup:
    """This rank's place in its engine's tensor-parallel group, shared by all its layers."""

    rank: int = 0
    size: int = 1
    process_group: object | None = None  # a torch.distributed backend; None for one rank

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place across ranks; returns `x`. `op`: "sum" or "min"."""
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}[op]
            self.process_group.allreduce([x], opts).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` concatenated along the last dim, on rank 0; None elsewhere."""
        if self.size == 1:
            return x
        opts = dist.GatherOptions()
        opts.rootRank = 0
        shards = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        outputs = [shards] if shards is not None else []  # only the root receives
        self.process_group.gather(outputs, [x.contiguous()], opts).wait()
        return torch.cat(shards, dim=-1) if shards is not None else None

    def shutdown(self) -> None:
        """Release the backend (NCCL communicators, sockets); no collective after. Every
        layer shares this object, so the backend is destroyed here and now, not at
        interpreter exit, where its threads' teardown can abort the process."""
        process_group, self.process_group = self.process_group, None
        if process_group is not None:
            process_group.shutdown()


SINGLE_RANK = TPGroup()
_current: Scoped[TPGroup] = Scoped(SINGLE_RANK)
tp_group_scope = _current.scope  # layers constructed inside shard over the group


def join_tp_group(store: dist.Store, rank: int, world_size: int, device: torch.device) -> TPGroup:
    backend = dist.ProcessGroupNCCL if device.type == "cuda" else dist.ProcessGroupGloo
    return TPGroup(rank, world_size, backend(store, rank, world_size, GROUP_TIMEOUT))


def get_tp_group() -> TPGroup:
    return _current.value
