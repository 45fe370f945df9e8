"""The draw from softmax(logits), in plain PyTorch on any device: the exponential race,
argmax(p / E) with E ~ Exp(1) iid per token, which draws exactly from p. It is a hot op: CUDA
compiles it into one pass, a CPU's platform draws by the inverse CDF instead
(platforms/cpu/ops.py, over inverse_cdf_index's search). A greedy row's argmax is a hot op too:
a CPU's is native (torch's compares one logit at a time). Filters, penalties and seeded rows have
modules of their own (filters.py, penalties.py, seeded.py)."""

import torch

from nanovllm.compilation import HotOp


@HotOp
def softmax_race(logits: torch.Tensor) -> torch.Tensor:
    """[B, vocab] logits -> [B] token ids drawn from softmax(logits), unseeded."""
    probs = torch.softmax(logits, dim=-1)
    return (probs / unseeded_noise(probs)).argmax(dim=-1)


@HotOp.uncompiled
def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """[B, vocab] logits -> [B] the token of each row's largest logit (the first of ties)."""
    return logits.argmax(dim=-1)


def inverse_cdf_index(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B, vocab] weights >= 0, [B, 1] float64 u in (0, 1] -> [B] the first token whose float64
    CDF reaches u * total: each token's step is its weight, so a weight-0 one is never chosen."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1)


def unseeded_noise(probs: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise as -log(U): on a CPU rand + log use every thread, exponential_() one.
    Clamped: a draw of 0 would make 0 / 0 for a filtered-out token."""
    return torch.rand_like(probs).log_().neg_().clamp_min_(1e-10)
