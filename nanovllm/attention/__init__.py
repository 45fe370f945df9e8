"""Attention over the paged KV cache behind one backend interface (backend.py): torch, triton,
flash_attn; the per-step metadata every layer reads (metadata.py)."""
