"""One token id per row of logits, every row with its own settings (vLLM's), in one pass:

    logit bias (min_tokens: stop ids -inf) -> penalties -> [greedy rows: argmax]
                                           -> temperature -> top-k -> top-p -> min-p -> sample

Each step's math is an op of kernels/sampling_ops.py; sampling there is the exponential race
(unseeded CPU rows: the inverse CDF), a seeded row's noise a hash of (seed, step, token id)."""

import torch
from torch import nn

from nanovllm.kernels.sampling_ops import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    inverse_cdf,
    seeded_exponentials,
    softmax_race,
    unseeded_noise,
)
from nanovllm.sampling.metadata import SamplingMetadata


class Sampler(nn.Module):
    def __init__(self):
        super().__init__()
        self._softmax_race = softmax_race.select()  # compiled on CUDA: one fused pass

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits [B, vocab] -> token ids [B]. The logits are overwritten."""
        m = metadata
        logits = logits.float()
        if m.bias is not None:  # logit_bias, and -inf where min_tokens forbids a stop id
            rows, ids, values = m.bias
            logits[rows, ids] += values
        if m.penalties is not None:
            p = m.penalties
            logits[p.rows] = apply_penalties(
                logits[p.rows], p.output_counts, p.in_prompt, p.repetition, p.presence, p.frequency
            )
        greedy_ids = None if m.greedy is None else logits.argmax(dim=-1)
        if m.all_greedy:
            return greedy_ids
        logits.div_(m.temperatures[:, None])
        if m.top_k is not None or m.top_p is not None:
            logits = apply_top_k_top_p(logits, m.top_k, m.max_top_k, m.top_p)
        if m.min_p is not None:
            logits = apply_min_p(logits, m.min_p)
        if m.seed_keys is None:
            sampled = inverse_cdf(logits) if logits.is_cpu else self._softmax_race(logits)
        else:  # seeded rows' noise is a function of (seed key, token id), the others' unseeded
            probs = torch.softmax(logits, dim=-1)
            noise = torch.empty_like(probs) if m.all_seeded else unseeded_noise(probs)
            noise[m.seeded_rows] = seeded_exponentials(m.seed_keys, probs.shape[1])
            sampled = (probs / noise).argmax(dim=-1)
        return sampled if greedy_ids is None else torch.where(m.greedy, greedy_ids, sampled)
