import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.compilation import HotOp


@HotOp
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(x[..., :d]) * x[..., d:] for the fused gate_up projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self._fn = silu_and_mul.select()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)
