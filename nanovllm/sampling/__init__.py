"""Sampling: the per-batch metadata built on the host (metadata.py) and the batched
sampler that applies it on the device (sampler.py)."""
