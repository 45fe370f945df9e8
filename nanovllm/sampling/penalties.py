"""vLLM's repetition, presence and frequency penalties, built into a batch's SamplingMetadata
(imported only once a request asks for one). Each penalized sequence's token counts stay on the
device across steps (TokenCounts), so a step sends only the tokens appended since the last."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanovllm.core.sequence import Sequence
from nanovllm.device import list_to_device


@dataclass(slots=True)
class Penalties:
    """The penalties of the rows that have one (P of the batch's B rows)."""

    rows: torch.Tensor  # [P] int64: their rows in the batch
    output_counts: torch.Tensor  # [P, vocab] float32: times each token is in the completion
    in_prompt: torch.Tensor  # [P, vocab] bool: token is in the prompt
    repetition: torch.Tensor  # [P] float32, 1 = off
    presence: torch.Tensor  # [P] float32, 0 = off
    frequency: torch.Tensor  # [P] float32, 0 = off

    def apply(self, logits: torch.Tensor) -> None:
        """Penalize the rows of [B, vocab] float32 `logits`, in place."""
        logits[self.rows] = apply_penalties(
            logits[self.rows],
            self.output_counts,
            self.in_prompt,
            self.repetition,
            self.presence,
            self.frequency,
        )


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    in_prompt: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on [P, vocab]: repetition (prompt and completion: positive logits
    divided by it, negative ones multiplied), then presence and frequency (completion only)."""
    in_output = output_counts > 0
    repetition = repetition[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(in_output | in_prompt, penalized, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * in_output


def build_penalties(
    seqs: list[Sequence], counts: "TokenCounts", put: Callable[[list], torch.Tensor]
) -> Penalties | None:
    """The penalized rows of a batch, their `counts` updated; None when no row has a penalty.
    `put`: a list onto the logits' device."""
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


@dataclass(slots=True)
class _Tracked:
    seq: Sequence
    slot: int
    num_counted: int = 0  # tokens of seq already in its slot's counts


class TokenCounts:
    """Per-sequence token counts on the device. Slot s (one per tracked sequence, freed once it
    has finished) holds output_counts[s] (times each token is in the completion) and
    in_prompt[s]."""

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
            ones = torch.ones(len(output), device=self.device)
            self.output_counts.index_put_(self._index(output), ones, accumulate=True)
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
