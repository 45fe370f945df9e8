"""What the sampler needs to know about a batch (a None field: no row needs it), from rank 0."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanovllm.core.sequence import Sequence
from nanovllm.device import list_to_device

if TYPE_CHECKING:
    from nanovllm.sampling.filters import Filters
    from nanovllm.sampling.penalties import Penalties, TokenCounts
    from nanovllm.sampling.seeded import SeededRows
    from nanovllm.structured.matchers import GrammarMask, GrammarMatchers


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row settings of a batch of B rows, on the logits' device."""

    temperatures: torch.Tensor  # [B] float32; greedy rows hold 1.0
    greedy: torch.Tensor | None = None  # [B] bool; None when no row is greedy
    all_greedy: bool = False
    bias: tuple[torch.Tensor, ...] | None = None  # [N] rows, [N] token ids, [N] float32 to add
    penalties: "Penalties | None" = None  # penalties.py
    filters: "Filters | None" = None  # top-k, top-p, min-p: filters.py
    seeds: "SeededRows | None" = None  # the seeded sampled rows: seeded.py
    grammar: "GrammarMask | None" = None  # structured outputs' token bitmask: structured/


class SamplingMetadataBuilder:
    """Builds each step's SamplingMetadata on rank 0. It keeps, across steps, what penalties
    count (penalties.py's TokenCounts) and grammars' matchers (structured/), made once asked."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.token_counts: TokenCounts | None = None
        self.grammars: GrammarMatchers | None = None  # set by structured.prepare(), if asked

    def build(self, seqs: list[Sequence]) -> SamplingMetadata:
        """The per-row tensors of a batch, on the device; features no row uses stay None.
        Settings are read once per distinct SamplingParams (a batch usually shares one) and
        spread to the rows."""
        all_params = [seq.sampling_params for seq in seqs]
        distinct = {id(p): p for p in all_params}  # each SamplingParams once, first seen first
        params = list(distinct.values())
        if len(params) == 1:  # no per-row lookups
            row_params = np.zeros(len(seqs), np.int64)
        else:
            index = {key: i for i, key in enumerate(distinct)}
            row_params = np.array([index[id(p)] for p in all_params])
        greedy = np.array([p.is_greedy for p in params])[row_params]
        temperatures = np.array([1.0 if p.is_greedy else p.temperature for p in params])
        m = SamplingMetadata(
            temperatures=self.put(temperatures.astype(np.float32)[row_params]),
            all_greedy=bool(greedy.all()),
        )
        if greedy.any():
            m.greedy = self.put(greedy)
        if any(p.min_tokens or p.logit_bias for p in params):
            from nanovllm.sampling.bias import build_bias

            m.bias = build_bias(seqs, self.put)
        if any(p.has_penalties for p in params):
            from nanovllm.sampling.penalties import build_penalties

            m.penalties = build_penalties(seqs, self)
        if any(p.structured_outputs is not None for p in params):
            m.grammar = self.grammars.build(seqs)
        if not m.all_greedy:
            if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
                from nanovllm.sampling.filters import build_filters

                m.filters = build_filters(params, row_params, ~greedy, self.vocab_size, self.put)
            if any(p.seed is not None for p in params):
                from nanovllm.sampling.seeded import seeded_rows

                m.seeds = seeded_rows(seqs, ~greedy, self.put)
        return m

    def put(self, data: list | np.ndarray) -> torch.Tensor:
        return list_to_device(data, self.device)
