"""What the sampler needs to know about a batch (a None field: no row needs it), from rank 0."""

from dataclasses import dataclass
from hashlib import blake2b
from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F

from nanovllm.core.sequence import Sequence
from nanovllm.runner.device import list_to_device
from nanovllm.sampling_params import SamplingParams


@dataclass(slots=True)
class Penalties:
    """vLLM's penalties for the rows that have one (P of the batch's B rows)."""

    rows: torch.Tensor  # [P] int64: their rows in the batch
    output_counts: torch.Tensor  # [P, vocab] float32: times each token is in the completion
    in_prompt: torch.Tensor  # [P, vocab] bool: token is in the prompt
    repetition: torch.Tensor  # [P] float32, 1 = off
    presence: torch.Tensor  # [P] float32, 0 = off
    frequency: torch.Tensor  # [P] float32, 0 = off


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row settings of a batch of B rows, on the logits' device."""

    temperatures: torch.Tensor  # [B] float32; greedy rows hold 1.0
    greedy: torch.Tensor | None = None  # [B] bool; None when no row is greedy
    all_greedy: bool = False
    top_k: torch.Tensor | None = None  # [B] int64; vocab size = keep all
    max_top_k: int = 0  # the largest k below the vocab size
    top_p: torch.Tensor | None = None  # [B] float32; 1.0 = keep all
    min_p: torch.Tensor | None = None  # [B] float32; 0.0 = keep all
    seeded_rows: torch.Tensor | None = None  # [S] int64
    seed_keys: torch.Tensor | None = None  # [S] int64, 32-bit keys (see seed_key)
    all_seeded: bool = False
    penalties: Penalties | None = None
    bias: tuple[torch.Tensor, ...] | None = None  # [N] rows, [N] token ids, [N] float32 to add


def seed_key(seed: int, step: int) -> int:
    """The 32-bit key of a seeded row's noise at its `step`-th token: nothing else in the batch."""
    digest = blake2b(f"{seed}:{step}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@dataclass(slots=True)
class _Tracked:
    seq: Sequence
    slot: int
    num_counted: int = 0  # tokens of seq already in its slot's counts


class TokenCounts:
    """Per-sequence token counts on the device, kept across steps so a step sends only the
    tokens appended since the last one. Slot s (one per tracked sequence, freed once it has
    finished) holds output_counts[s] (times each token is in the completion) and in_prompt[s]."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.device = device
        self.output_counts = torch.zeros(0, vocab_size, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.tracked: dict[int, _Tracked] = {}  # seq_id -> its slot
        self._true = torch.ones((), dtype=torch.bool, device=device)
        self.free_slots: list[int] = []

    def update(self, seqs: list[Sequence]) -> torch.Tensor:
        """Count the tokens of `seqs` not counted yet; returns their slots [len(seqs)]."""
        for seq_id in [i for i, entry in self.tracked.items() if entry.seq.is_finished]:
            self.free_slots.append(self.tracked.pop(seq_id).slot)
        prompt, output = [], []  # (slot, token id) of each token not counted yet
        for seq in seqs:
            entry = self.tracked.get(seq.seq_id) or self._assign(seq)
            split = max(entry.num_counted, seq.num_prompt_tokens)
            prompt += [(entry.slot, t) for t in seq.token_ids[entry.num_counted : split]]
            output += [(entry.slot, t) for t in seq.token_ids[split:]]
            entry.num_counted = len(seq)
        if prompt:  # a device-side True: a Python scalar would be a blocking copy
            self.in_prompt.index_put_(self._index(prompt), self._true)
        if output:
            self.output_counts.index_put_(
                self._index(output), torch.ones(len(output), device=self.device), accumulate=True
            )
        return list_to_device([self.tracked[seq.seq_id].slot for seq in seqs], self.device)

    def _index(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
        return list_to_device(pairs, self.device).unbind(1)  # [n, 2]: one transfer

    def _assign(self, seq: Sequence) -> _Tracked:
        if not self.free_slots:  # double the slots (at least 8 more), zero-padded
            old = self.output_counts.shape[0]
            self.output_counts = F.pad(self.output_counts, (0, 0, 0, max(8, old)))
            self.in_prompt = F.pad(self.in_prompt, (0, 0, 0, max(8, old)))
            self.free_slots.extend(range(self.output_counts.shape[0] - 1, old - 1, -1))
        entry = self.tracked[seq.seq_id] = _Tracked(seq, self.free_slots.pop())
        self.output_counts[entry.slot].zero_()
        self.in_prompt[entry.slot].zero_()
        return entry


def build_sampling_metadata(
    seqs: list[Sequence], vocab_size: int, token_counts: TokenCounts, device: torch.device
) -> SamplingMetadata:
    """The per-row tensors of a batch, on `device`; features no row uses stay None. Settings
    are read once per distinct SamplingParams (a batch usually shares one) and spread to rows."""

    def put(data: list | np.ndarray) -> torch.Tensor:
        return list_to_device(data, device)

    all_params = [seq.sampling_params for seq in seqs]
    distinct = {id(p): p for p in all_params}  # each SamplingParams once, first seen first
    params, index = list(distinct.values()), {key: i for i, key in enumerate(distinct)}
    row_params = (
        np.zeros(len(seqs), np.int64)
        if len(params) == 1  # no per-row lookups
        else np.array([index[id(p)] for p in all_params])
    )
    greedy = np.array([p.is_greedy for p in params])[row_params]
    m = SamplingMetadata(
        temperatures=put(
            np.array([1.0 if p.is_greedy else p.temperature for p in params], np.float32)[
                row_params
            ]
        ),
        all_greedy=bool(greedy.all()),
    )
    if greedy.any():
        m.greedy = put(greedy)
    if any(p.min_tokens or p.logit_bias for p in params):
        m.bias = _bias(seqs, put)
    if any(p.has_penalties for p in params):
        m.penalties = _penalties(seqs, token_counts, put)
    if not m.all_greedy:
        _add_filters(m, params, row_params, ~greedy, vocab_size, put)
        if any(p.seed is not None for p in params):
            _add_seeds(m, seqs, ~greedy, put)
    return m


def _add_filters(
    m: SamplingMetadata,
    params: list[SamplingParams],
    row_params: np.ndarray,
    sampled: np.ndarray,
    vocab_size: int,
    put,
) -> None:
    # Greedy rows keep everything: their token is the argmax, taken before the filters.
    if not any(0 < p.top_k < vocab_size or p.top_p < 1 or p.min_p > 0 for p in params):
        return  # no row is filtered: no per-row arrays
    top_k = np.where(
        sampled,
        np.array([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params])[row_params],
        vocab_size,
    )
    top_p = np.where(sampled, np.array([p.top_p for p in params], np.float32)[row_params], 1)
    min_p = np.where(sampled, np.array([p.min_p for p in params], np.float32)[row_params], 0)
    if top_k.min() < vocab_size:
        m.top_k = put(top_k)
        m.max_top_k = int(top_k[top_k < vocab_size].max())
    if top_p.min() < 1:
        m.top_p = put(top_p.astype(np.float32))
    if min_p.max() > 0:
        m.min_p = put(min_p.astype(np.float32))


def _add_seeds(m: SamplingMetadata, seqs: list[Sequence], sampled: np.ndarray, put) -> None:
    seeded = [
        i for i, seq in enumerate(seqs) if sampled[i] and seq.sampling_params.seed is not None
    ]
    if seeded:
        m.seeded_rows = put(seeded)
        m.seed_keys = put(
            [seed_key(seqs[i].sampling_params.seed, seqs[i].num_completion_tokens) for i in seeded]
        )
        m.all_seeded = len(seeded) == int(sampled.sum())


def _bias(seqs: list[Sequence], put) -> tuple[torch.Tensor, ...] | None:
    """(rows, token ids, values) to add to the logits, one entry per (row, id): logit_bias, and
    -inf for the stop ids that min_tokens forbids (each sequence's, EOS unless ignored)."""
    biases = [
        seq.sampling_params.logit_bias | dict.fromkeys(seq.stop_token_ids, float("-inf"))
        if seq.num_completion_tokens < seq.sampling_params.min_tokens
        else seq.sampling_params.logit_bias
        for seq in seqs
    ]
    if not (total := sum(lens := [len(bias) for bias in biases])):
        return None
    ids = np.fromiter(chain.from_iterable(biases), np.int64, total)  # 2x faster than lists
    values = np.fromiter(chain.from_iterable(b.values() for b in biases), np.float32, total)
    return *put(np.stack([np.repeat(np.arange(len(seqs)), lens), ids])), put(values)


def _penalties(seqs: list[Sequence], counts: TokenCounts, put) -> Penalties | None:
    rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.has_penalties]
    if not rows:
        return None
    slots = counts.update([seqs[i] for i in rows])
    params = [seqs[i].sampling_params for i in rows]
    repetition, presence, frequency = put(
        [[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in params]
    ).unbind(1)
    return Penalties(
        rows=put(rows),
        output_counts=counts.output_counts[slots],
        in_prompt=counts.in_prompt[slots],
        repetition=repetition,
        presence=presence,
        frequency=frequency,
    )
