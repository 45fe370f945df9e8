"""top-k, top-p and min-p (imported only once a request asks for one): the logits they filter
out set to -inf, after temperature and before the draw, each row with its own settings."""

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.sampling_params import SamplingParams


@dataclass(slots=True)
class Filters:
    """A batch's filters (a None field: no row has it)."""

    top_k: torch.Tensor | None = None  # [B] int64; vocab size = keep all
    max_top_k: int = 0  # the largest k below the vocab size
    top_p: torch.Tensor | None = None  # [B] float32; 1.0 = keep all
    min_p: torch.Tensor | None = None  # [B] float32; 0.0 = keep all

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.top_k is not None or self.top_p is not None:
            logits = apply_top_k_top_p(logits, self.top_k, self.max_top_k, self.top_p)
        if self.min_p is not None:
            logits = apply_min_p(logits, self.min_p)
        return logits


def build_filters(
    params: list[SamplingParams], row_params: np.ndarray, sampled: np.ndarray, vocab_size: int, put
) -> Filters | None:
    """The filters of a batch: `params` its distinct SamplingParams, row_params each row's
    index into them, `sampled` its rows that sample. Greedy rows keep everything: their token
    is the argmax, taken before the filters. None when no row is filtered."""
    ks = np.array([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params])
    top_k = np.where(sampled, ks[row_params], vocab_size)
    top_p = np.where(sampled, np.array([p.top_p for p in params], np.float32)[row_params], 1)
    min_p = np.where(sampled, np.array([p.min_p for p in params], np.float32)[row_params], 0)
    filters = Filters()
    if top_k.min() < vocab_size:
        filters.top_k = put(top_k)
        filters.max_top_k = int(top_k[top_k < vocab_size].max())
    if top_p.min() < 1:
        filters.top_p = put(top_p.astype(np.float32))
    if min_p.max() > 0:
        filters.min_p = put(min_p.astype(np.float32))
    if filters.top_k is None and filters.top_p is None and filters.min_p is None:
        return None  # every k at least the vocabulary, every p 1, every min_p 0
    return filters


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
