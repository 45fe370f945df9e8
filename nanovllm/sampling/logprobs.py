"""Logprobs of the model's raw distribution (vLLM v1's default: before penalties, temperature
and filters), for the sequences that ask. An entry is {token id: Logprob}: the chosen token
(sampled, or the prompt's next) ranked 1 + the others at least as likely, then the top k.
Logits rows: sequence i owns rows[i] consecutive ones (logits_rows); in a prefill chunk
starting at position s, its row j predicts token s + j + 1; its last row samples."""

from itertools import islice
from typing import NamedTuple

import torch

from nanovllm.core.sequence import Sequence, logits_rows
from nanovllm.device import to_device
from nanovllm.outputs import Logprob
from nanovllm.sampling.metadata import SamplingMetadataBuilder
from nanovllm.sampling.sampler import Sampler, SamplerOutput


def sample_with_logprobs(
    sampler: Sampler, metadata: SamplingMetadataBuilder, seqs: list[Sequence], logits: torch.Tensor
) -> SamplerOutput:
    """The sampling step when a sequence of the batch asks for logprobs: they are taken from
    the raw logits first (the sampler overwrites them), then gathered at the sampled tokens."""
    rows = logits_rows(seqs)
    asked = find_logprob_rows(seqs, rows)
    raw = None if asked is None else raw_logprobs(logits, asked)
    if rows is not None:  # prompt rows too: each sequence samples from its last
        logits = logits[to_device(torch.tensor(rows).cumsum(0) - 1, logits.device)]
    token_ids = sampler(logits, metadata.build(seqs))
    if asked is None:
        return SamplerOutput(token_ids)
    return SamplerOutput(token_ids, *collect_logprobs(asked, raw, token_ids, len(seqs)))


class LogprobRows(NamedTuple):
    """The logits rows a step computes logprobs of: prompt rows, then sampling rows."""

    picks: list[int]  # logits rows
    ks: list[int]  # the top-k size of each
    prompt_targets: list[int]  # the token each prompt pick predicts
    prompt_counts: list[int]  # per sequence, how many of the prompt picks are its
    sample_rows: list[int]  # batch rows whose sampled token wants logprobs


def record_logprobs(seqs: list[Sequence], out: SamplerOutput) -> None:
    """A step's logprob entries into the sequences that asked, but those that ended while it
    ran (the engine's postprocess)."""
    for seq, entry in zip(seqs, out.logprobs or ()):
        if entry is not None and not seq.is_finished:
            seq.logprobs.append(entry)
    for seq, entries in zip(seqs, out.prompt_logprobs or ()):
        if entries and not seq.is_finished:
            seq.prompt_logprobs.extend(entries)


def find_logprob_rows(seqs: list[Sequence], rows: list[int] | None) -> LogprobRows | None:
    """None when no sequence needs logprobs this step (the common case: one scan). Prompt
    tokens already recorded (a prompt recomputed after a preemption) are skipped."""
    if rows is None and all(seq.logprobs is None for seq in seqs):
        return None
    asked = LogprobRows([], [], [], [], [])
    sample_picks, sample_ks, offset = [], [], 0
    for i, (seq, n) in enumerate(zip(seqs, rows or [1] * len(seqs))):
        start, lo, hi = seq.num_cached_tokens, 0, 0  # it predicts prompt tokens [lo, hi)
        if seq.needs_prompt_logits:
            lo = max(start + 1, len(seq.prompt_logprobs))
            hi = max(lo, min(start + n + 1, seq.num_prompt_tokens))
        asked.picks.extend(range(offset + lo - start - 1, offset + hi - start - 1))
        asked.ks.extend([seq.sampling_params.prompt_logprobs] * (hi - lo))
        asked.prompt_targets.extend(seq.token_ids[lo:hi])
        asked.prompt_counts.append(hi - lo)
        offset += n
        if seq.logprobs is not None and start + seq.num_scheduled_tokens == len(seq):
            asked.sample_rows.append(i)
            sample_picks.append(offset - 1)
            sample_ks.append(seq.sampling_params.logprobs)
    asked.picks.extend(sample_picks)
    asked.ks.extend(sample_ks)
    return asked if asked.picks else None


def raw_logprobs(logits: torch.Tensor, asked: LogprobRows) -> torch.Tensor:
    """[len(picks), vocab] float32, taken before the sampler overwrites the logits."""
    return logits[to_device(torch.tensor(asked.picks), logits.device)].float().log_softmax(-1)


def collect_logprobs(
    asked: LogprobRows, logprobs: torch.Tensor, sampled: torch.Tensor, num_seqs: int
) -> tuple[list[dict | None], list[list[dict]]]:
    """Per sequence: the sampled token's entry (or None), and its new prompt entries. Row r of
    logprobs [R, vocab] gives its chosen token's entry and the top ks[r] (one host sync)."""
    targets = to_device(torch.tensor(asked.prompt_targets, dtype=torch.long), sampled.device)
    rows = to_device(torch.tensor(asked.sample_rows, dtype=torch.long), sampled.device)
    chosen = torch.cat([targets, sampled[rows]])  # [R]
    top = logprobs.topk(min(max(asked.ks), logprobs.shape[1]), dim=-1)
    chosen_logprobs = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)
    entries = []  # prompt entries, sequence by sequence, then the sampled ones
    for k, token, logprob, rank, ids, values in zip(
        asked.ks,
        chosen.tolist(),
        chosen_logprobs[:, 0].tolist(),
        ranks.tolist(),
        top.indices.tolist(),
        top.values.tolist(),
    ):
        top_k = {i: Logprob(v, r) for r, (i, v) in enumerate(zip(ids[:k], values[:k]), 1)}
        entries.append({token: Logprob(logprob, rank)} | top_k)  # the chosen one first
    rest = iter(entries)
    prompt = [list(islice(rest, count)) for count in asked.prompt_counts]
    sample: list[dict | None] = [None] * num_seqs
    for row, entry in zip(asked.sample_rows, rest):
        sample[row] = entry
    return sample, prompt
