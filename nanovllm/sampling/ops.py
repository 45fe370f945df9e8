"""The draw from softmax(logits), in plain PyTorch on any device: the exponential race,
argmax(p / E) with E ~ Exp(1) iid per token, which draws exactly from p; on a CPU an unseeded
row is drawn by the inverse CDF instead, in C++ where it builds (kernels/cpu_sample.py).
Filters, penalties and seeded rows have modules of their own (filters.py, penalties.py,
seeded.py)."""

import torch

from nanovllm.compilation import HotOp
from nanovllm.kernels import cpu_sample


@HotOp
def softmax_race(logits: torch.Tensor) -> torch.Tensor:
    """[B, vocab] logits -> [B] token ids drawn from softmax(logits), unseeded."""
    probs = torch.softmax(logits, dim=-1)
    return (probs / unseeded_noise(probs)).argmax(dim=-1)


def inverse_cdf(logits: torch.Tensor) -> torch.Tensor:
    """softmax_race's draw on a CPU: one uniform a row from torch.rand (a manual_seed
    reproduces it), searched in a float64 CDF of the softmax (float64 keeps each token's
    probability as its step; a float32 sum over a real vocabulary would round tiny ones to
    nothing). A probability-0 token (filtered to -inf) is never drawn. Fused in
    cpu_sample.cpp where it builds (nothing [B, vocab] written: 2-3x faster than torch's
    softmax and cumsum, themselves 3-5x faster than the race's noise), else those."""
    u = 1 - torch.rand(len(logits), 1, dtype=torch.float64)  # (0, 1]: never a p = 0 token's CDF
    library = cpu_sample.load() if logits.dtype == torch.float32 else None
    if library is None:
        return inverse_cdf_index(torch.softmax(logits, dim=-1), u)
    return cpu_sample.sample(library, logits, u)


def inverse_cdf_index(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B, vocab] weights >= 0, [B, 1] float64 u in (0, 1] -> [B] the first token whose float64
    CDF reaches u * total: each token's step is its weight, so a weight-0 one is never chosen."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1)


def unseeded_noise(probs: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise as -log(U): on a CPU rand + log use every thread, exponential_() one (14% of
    a decode step). Clamped: a draw of 0 would make 0 / 0 for a filtered-out token."""
    return torch.rand_like(probs).log_().neg_().clamp_min_(1e-10)
