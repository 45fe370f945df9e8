"""Launched by torchrun (or SLURM, or anything that sets its variables): every rank runs the
user's script, builds the same engine and steps it in lockstep; the first rank of each
tensor-parallel group samples and broadcasts the tokens. Ranks are laid out

    world rank = dp_rank * tensor_parallel_size + tp_rank     (one replica's ranks adjacent)
"""

import os
import pickle
from dataclasses import dataclass
from itertools import count

import torch
import torch.distributed as dist

from nanovllm.distributed import launched_by_torchrun
from nanovllm.distributed.collectives import GROUP_TIMEOUT, join_tp_group
from nanovllm.distributed.group import SINGLE_RANK, TPGroup

_engine_ids = count()  # every rank builds its engines in the same order: ids agree


@dataclass(frozen=True, slots=True)
class Torchrun:
    rank: int  # in the world
    world_size: int
    local_rank: int  # on its node: its GPU
    tp_size: int
    dp_rank: int  # its replica
    tp_rank: int  # in its replica


def torchrun_launch(tp_size: int, dp_size: int) -> Torchrun | None:
    """This process's place in torchrun's world, or None when not launched by it; a world
    that is not tp_size * dp_size ranks is refused (before any weight loads)."""
    if not launched_by_torchrun():
        return None
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != tp_size * dp_size:
        raise ValueError(
            f"torchrun started {world_size} ranks but tensor_parallel_size="
            f"{tp_size} x data_parallel_size={dp_size} = {tp_size * dp_size}; "
            "make --nnodes x --nproc-per-node equal their product"
        )
    rank = int(os.environ["RANK"])
    return Torchrun(
        rank, world_size, int(os.environ.get("LOCAL_RANK", 0)), tp_size, *divmod(rank, tp_size)
    )


def engine_store(launch: Torchrun) -> dist.Store:
    """A key space of this engine's own in torchrun's store (the agent's, when it hosts one;
    else rank 0 opens it on MASTER_PORT)."""
    is_master = launch.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        launch.world_size,
        is_master=is_master,
        timeout=GROUP_TIMEOUT,
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"nanovllm/engine{next(_engine_ids)}", store)


def join_replica_tp_group(launch: Torchrun, store: dist.Store, device: torch.device) -> TPGroup:
    if launch.tp_size == 1:
        return SINGLE_RANK
    return join_tp_group(
        dist.PrefixStore(f"tp{launch.dp_rank}", store), launch.tp_rank, launch.tp_size, device
    )


def all_gather_objects(group: TPGroup, obj: object, device: torch.device) -> list[object]:
    """Every rank's `obj`, in rank order, on every rank (pickled; `device`: the backend's): how
    torchrun's ranks, each running the engine, share rank 0's tokens and the replicas' outputs."""
    if group.size == 1:
        return [obj]
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(group.size)]
    length = torch.tensor([data.numel()], device=device)
    group.process_group.allgather([sizes], [length]).wait()
    padded = torch.zeros(int(max(sizes).item()), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    shards = [torch.empty_like(padded) for _ in range(group.size)]
    group.process_group.allgather([shards], [padded]).wait()
    return [
        pickle.loads(shard[: int(size.item())].cpu().numpy().tobytes())
        for shard, size in zip(shards, sizes)
    ]
