"""Parallelism: the TP group (group.py), spawned worker ranks (workers.py) and torchrun's ranks
(launch.py). Data-parallel replicas are whole LLMs: entrypoints/data_parallel.py."""
