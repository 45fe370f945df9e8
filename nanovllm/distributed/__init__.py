"""Parallelism. Every layer shards over the tensor-parallel group current while it is built
(group.py: a single rank unless one is set). The rest is imported only when a run is parallel:
ranks 1..N-1 spawned by rank 0 (workers.py), the ranks torchrun started (launch.py), and
data-parallel replicas, whole engines that split the prompts (data_parallel.py)."""

import os

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """torchrun (or SLURM, or anything that sets its variables) started this process."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)
