"""Tensor parallelism: the process group a model shards over (group.py) and the spawned
worker ranks rank 0 drives (workers.py)."""
