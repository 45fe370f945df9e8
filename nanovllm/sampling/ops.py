"""The sampler's math on [B, vocab] logits, in plain PyTorch on any device (sampler.py runs
them in order): the filters, and the draw. Sampling is the exponential race, argmax(p / E) with
E ~ Exp(1) iid per token, which draws exactly from p; on a CPU an unseeded row is drawn by the
inverse CDF instead, in C++ where it builds (kernels/cpu_sample.py). Penalties and seeded
rows have modules of their own (penalties.py, seeded.py)."""

import torch

from nanovllm.compilation import HotOp
from nanovllm.kernels import cpu_sample


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set the logits that top-k, then top-p, filter out to -inf (ties with the k-th stay)."""
    if top_p is None:  # top-k alone needs only the max_top_k largest values, not a sort
        values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k]
        kth = values.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])
        kth = torch.where(top_k[:, None] > max_top_k, float("-inf"), kth)  # rows keeping all
        return logits.masked_fill_(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[1] - top_k)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    # Ascending, a token goes when those ranked at or below it hold at most 1 - p: those above
    # reach p without it. The one crossing p stays; p = 1 drops only probability-0 tokens.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p[:, None]
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with p < min_p * p_max: logit < max logit + log(min_p) (log 0 keeps all)."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill_(logits < threshold, float("-inf"))


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
