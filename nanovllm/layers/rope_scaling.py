"""RoPE scaling: Llama 3.1's `llama3` rope_type (imported only for a checkpoint that has it)."""

import math

import torch

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Wavelengths above original_max_position_embeddings / low_freq_factor divided by factor,
    below .../high_freq_factor kept, smoothed between; HF's code step for step (same rounding)."""
    missing = [name for name in LLAMA3_KEYS if name not in params]
    if missing:
        raise ValueError(
            f"rope_type 'llama3' needs {', '.join(missing)} in rope_scaling (rope_parameters)"
        )
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
