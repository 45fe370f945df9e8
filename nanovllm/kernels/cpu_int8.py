"""Int8 weights on a CPU: per-channel symmetric quantization and the GEMM that reads them.
(Interim: the C++ kernel is being written; until then load() is None and layers dequantize.)"""

import ctypes

import torch


def load() -> ctypes.CDLL | None:
    return None


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] int8, scale [N] float32): scale = max|w_row| / 127 (1 for a
    zero row), q = round(w / scale)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    qweight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return qweight, scale


def pack(qweight: torch.Tensor) -> torch.Tensor:
    return qweight


def dequantize(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scale[:, None]


def linear(
    library: ctypes.CDLL,
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    raise NotImplementedError("the int8 kernel is not built yet")
