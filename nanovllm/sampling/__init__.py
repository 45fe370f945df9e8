"""Sampling: the per-batch metadata built on the host, and the sampler that applies it; what a
request may ask beyond a temperature is a module of its own, imported when a batch asks."""
