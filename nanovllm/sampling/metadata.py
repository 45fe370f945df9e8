"""What the sampler needs to know about a batch (a None field: no row needs it), from rank 0."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from nanovllm.core.sequence import Sequence
from nanovllm.device import list_to_device
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.sampling.filters import Filters
    from nanovllm.sampling.penalties import Penalties, TokenCounts
    from nanovllm.sampling.seeded import SeededRows


class LogitsMask(Protocol):
    """What a logits hook makes of a batch: the tokens some of its rows may not sample."""

    def apply(self, logits: torch.Tensor) -> None:
        """-inf, in place, where a row may not sample a token ([B, vocab] float32)."""
        ...


class LogitsHook(Protocol):
    """A seam of the sampler: each step, a mask over the logits before sampling, from state the
    hook keeps across steps (structured outputs' grammar matchers, structured/matchers.py).
    Given to the runner (ModelRunner.add_logits_hook) by the feature that owns it."""

    def build(self, seqs: list[Sequence]) -> LogitsMask | None:
        """This batch's mask; None when it constrains no row."""
        ...


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row settings of a batch of B rows, on the logits' device."""

    temperatures: torch.Tensor | None = None  # [B] float32, greedy rows 1.0; None: all greedy
    greedy: torch.Tensor | None = None  # [B] bool; None when no row, or every row, is greedy
    all_greedy: bool = False
    bias: tuple[torch.Tensor, ...] | None = None  # [N] rows, [N] token ids, [N] float32 to add
    penalties: "Penalties | None" = None  # penalties.py
    filters: "Filters | None" = None  # top-k, top-p, min-p: filters.py
    seeds: "SeededRows | None" = None  # the seeded sampled rows: seeded.py
    masks: tuple[LogitsMask, ...] = ()  # the logits hooks' (structured outputs' grammars)


class SamplingMetadataBuilder:
    """Builds each step's SamplingMetadata on rank 0. It keeps, across steps, what penalties
    count (penalties.py's TokenCounts, made once asked) and the logits hooks it was given."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.token_counts: TokenCounts | None = None
        self.logits_hooks: list[LogitsHook] = []

    def add_logits_hook(self, hook: LogitsHook) -> None:
        self.logits_hooks.append(hook)

    def build(self, seqs: list[Sequence]) -> SamplingMetadata:
        """The per-row tensors of a batch, on the device; features no row uses stay None.
        Settings are read once per distinct SamplingParams (a batch usually shares one) and
        spread to the rows."""
        all_params = [seq.sampling_params for seq in seqs]
        distinct = {id(p): p for p in all_params}  # each SamplingParams once, first seen first
        params = list(distinct.values())
        m = SamplingMetadata(all_greedy=all(p.is_greedy for p in params))
        if any(p.min_tokens or p.logit_bias for p in params):
            from nanovllm.sampling.bias import build_bias

            m.bias = build_bias(seqs, self.put)
        if any(p.has_penalties for p in params):
            m.penalties = self._penalties(seqs)
        if self.logits_hooks:
            masks = (hook.build(seqs) for hook in self.logits_hooks)
            m.masks = tuple(mask for mask in masks if mask is not None)
        if not m.all_greedy:  # an argmax alone needs no per-row settings
            self._sampled_rows(m, seqs, params)
        return m

    def _sampled_rows(
        self, m: SamplingMetadata, seqs: list[Sequence], params: list[SamplingParams]
    ) -> None:
        """A batch with rows to sample: each row's temperature, which rows are greedy, and the
        filters and seeds its rows ask for (`params`: the batch's distinct SamplingParams)."""
        if len(params) == 1:  # no per-row lookups
            row_params = np.zeros(len(seqs), np.int64)
        else:
            index = {id(p): i for i, p in enumerate(params)}
            row_params = np.array([index[id(seq.sampling_params)] for seq in seqs])
        greedy = np.array([p.is_greedy for p in params])[row_params]
        temperatures = np.array([1.0 if p.is_greedy else p.temperature for p in params])
        m.temperatures = self.put(temperatures.astype(np.float32)[row_params])
        if greedy.any():
            m.greedy = self.put(greedy)
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            from nanovllm.sampling.filters import build_filters

            m.filters = build_filters(params, row_params, ~greedy, self.vocab_size, self.put)
        if any(p.seed is not None for p in params):
            from nanovllm.sampling.seeded import seeded_rows

            m.seeds = seeded_rows(seqs, ~greedy, self.put)

    def put(self, data: list | np.ndarray) -> torch.Tensor:
        return list_to_device(data, self.device)

    def _penalties(self, seqs: list[Sequence]) -> "Penalties | None":
        """The penalized rows, their token counts kept here from the first penalized batch on."""
        from nanovllm.sampling.penalties import TokenCounts, build_penalties

        if self.token_counts is None:
            self.token_counts = TokenCounts(self.vocab_size, self.device)
        return build_penalties(seqs, self.token_counts, self.put)
