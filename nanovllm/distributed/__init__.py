"""Parallelism: the TP group (group.py), spawned worker ranks (workers.py), torchrun's ranks
(launch.py) and data-parallel replicas (data_parallel.py)."""
