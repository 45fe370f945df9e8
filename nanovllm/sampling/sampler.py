"""One token id per row of logits, every row with its own settings (vLLM's), in one pass:

    logit bias (min_tokens: stop ids -inf) -> penalties -> masks -> [greedy rows: argmax]
                                                       -> temperature -> top-k/p, min-p -> sample

What a request may ask beyond a temperature is in a module of its own, imported only when a
batch asks: bias.py (logit_bias, min_tokens), penalties.py, filters.py (top-k/p, min-p),
seeded.py (seeds); masks come from logits hooks (metadata.py's LogitsHook: structured outputs'
grammars). The draw is sampling/ops.py's exponential race, or the
platform's twin of it (a CPU's: the inverse CDF)."""

from typing import NamedTuple

import torch
from torch import nn

from nanovllm.sampling.metadata import SamplingMetadata
from nanovllm.sampling.ops import greedy_ids, softmax_race


class SamplerOutput(NamedTuple):
    """A step's sampled tokens (rank 0's), and the logprobs its sequences asked for."""

    token_ids: torch.Tensor | list[int]  # [num_seqs]; ModelRunner.run returns them as a list
    logprobs: list[dict | None] | None = None  # per sequence: its sampled token's entry
    prompt_logprobs: list[list[dict]] | None = None  # per sequence: its new prompt entries


class Sampler(nn.Module):
    def __init__(self):
        super().__init__()
        self._draw = softmax_race.select()  # the platform's: compiled on CUDA, a CPU's own
        self._argmax = greedy_ids.select()  # torch's, or a CPU's own

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits [B, vocab] -> token ids [B]. The logits are overwritten."""
        m = metadata
        logits = logits.float()
        if m.bias is not None:  # logit_bias, and -inf where min_tokens forbids a stop id
            rows, ids, values = m.bias
            logits[rows, ids] += values
        if m.penalties is not None:
            m.penalties.apply(logits)
        for mask in m.masks:  # the logits hooks' (structured outputs': the grammars')
            mask.apply(logits)
        if m.all_greedy:
            return self._argmax(logits)
        greedy = None if m.greedy is None else self._argmax(logits)
        logits.div_(m.temperatures[:, None])
        if m.filters is not None:
            logits = m.filters.apply(logits)
        if m.seeds is not None:  # a seeded row's noise is a hash of (seed, step, token id)
            sampled = m.seeds.sample(logits)
        else:
            sampled = self._draw(logits)
        return sampled if greedy is None else torch.where(m.greedy, greedy, sampled)
