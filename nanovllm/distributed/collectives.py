"""A tensor-parallel group of several ranks and its collectives (imported when one is formed).
The collectives call the backend object itself: torch.distributed's functions look ranks up in a
registry our groups are not in."""

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.distributed.group import TPGroup

GROUP_TIMEOUT = timedelta(minutes=5)  # a collective waiting this long on a live rank fails


@dataclass(slots=True)
class ProcessGroupTP(TPGroup):
    process_group: object | None = None  # a torch.distributed backend

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}[op]
        self.process_group.allreduce([x], opts).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        opts = dist.GatherOptions()
        opts.rootRank = 0
        shards = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        outputs = [shards] if shards is not None else []  # only the root receives
        self.process_group.gather(outputs, [x.contiguous()], opts).wait()
        return torch.cat(shards, dim=-1) if shards is not None else None

    def shutdown(self) -> None:
        """Every layer shares this object, so the backend (NCCL communicators, sockets) is
        destroyed here and now, not at interpreter exit, where its threads' teardown can abort
        the process."""
        process_group, self.process_group = self.process_group, None
        if process_group is not None:
            process_group.shutdown()


def join_tp_group(store: dist.Store, rank: int, world_size: int, device: torch.device) -> TPGroup:
    backend = dist.ProcessGroupNCCL if device.type == "cuda" else dist.ProcessGroupGloo
    return ProcessGroupTP(rank, world_size, backend(store, rank, world_size, GROUP_TIMEOUT))
