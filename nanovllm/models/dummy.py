"""load_format="dummy" (vLLM's): random weights from config.json alone, for benchmarks of a
model's shape without its checkpoint."""

import torch
from torch import nn


@torch.no_grad()
def load_dummy_weights(model: nn.Module, initializer_range: float = 0.02, seed: int = 0) -> None:
    """Random weights from the config alone (vLLM's load_format='dummy'): norms are 1,
    biases 0, other matrices N(0, initializer_range)."""
    generator = None
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            if generator is None:
                generator = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, initializer_range, generator=generator)
