"""Sampling: the per-batch metadata built on the host, and the sampler that applies it."""
