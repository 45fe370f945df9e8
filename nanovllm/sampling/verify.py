"""Sampling a step that verifies drafts (speculative decoding: engine/speculative.py has the
method). A decoding sequence with d drafts has 1 + d logits rows; each is sampled with its own
position's settings, as plain decoding would sample that token (temperature, top-k/p, min-p,
logit_bias, min_tokens, seed: a seeded row draws the noise plain decoding would at that token),
and logprobs are taken per position. Imported only with speculation."""

from itertools import accumulate
from typing import NamedTuple

import torch

from nanovllm.core.sequence import Sequence
from nanovllm.device import to_device
from nanovllm.sampling.logprobs import LogprobRows, collect_logprobs, raw_logprobs
from nanovllm.sampling.metadata import SamplingMetadataBuilder
from nanovllm.sampling.sampler import Sampler, SamplerOutput
from nanovllm.sampling_params import SamplingParams


class Position(NamedTuple):
    """What the sampler reads of a sequence, at one of its verified rows."""

    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]
    num_completion_tokens: int  # before this position's token: its seed step, min_tokens


class VerifyOutput(NamedTuple):
    """Rank 0's samples of a step with drafts."""

    plain: SamplerOutput  # the sequences without drafts, as ModelRunner.run returns them
    sampled: list[int]  # the verified sequences' tokens, 1 + d each, in batch order
    logprobs: list[dict | None] | None  # each verified row's entry, if any sequence asked


def split_rows(
    logits: torch.Tensor, rows: list[int], is_verified: list[bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [sum(rows), vocab], sequence i owning rows[i] consecutive rows -> the rows of the
    plain sequences and those of the verified ones, each in batch order."""
    if all(is_verified):  # every row verified (a lone stream, say): nothing to split
        return logits[:0], logits
    offsets = list(accumulate(rows, initial=0))
    split: list[list[int]] = [[], []]
    for i, verified in enumerate(is_verified):
        split[verified].extend(range(offsets[i], offsets[i + 1]))
    plain, verified = (to_device(torch.tensor(r, dtype=torch.long), logits.device) for r in split)
    return logits[plain], logits[verified]


@torch.inference_mode()
def sample_positions(
    sampler: Sampler,
    builder: SamplingMetadataBuilder,
    seqs: list[Sequence],
    drafts: dict[int, list[int]],
    logits: torch.Tensor,
) -> tuple[torch.Tensor, list[dict | None] | None]:
    """The target's token at each of the verified sequences' rows ([1 + d] each, logits in that
    order), each sampled with its position's settings; and, if any sequence asks, each row's
    logprob entry (of the raw logits, as plain decoding's), else None."""
    positions = [
        Position(seq.sampling_params, seq.stop_token_ids, seq.num_completion_tokens - d + j)
        for seq in seqs
        for d in [len(drafts[seq.seq_id])]
        for j in range(d + 1)
    ]
    asked = None
    if any(seq.logprobs is not None for seq in seqs):
        rows = [i for i, p in enumerate(positions) if p.sampling_params.logprobs is not None]
        ks = [positions[i].sampling_params.logprobs for i in rows]
        asked = LogprobRows(rows, ks, [], [], rows)
        raw = raw_logprobs(logits, asked)  # before the sampler overwrites the logits
    token_ids = sampler(logits, builder.build(positions))
    if asked is None:
        return token_ids, None
    return token_ids, collect_logprobs(asked, raw, token_ids, len(positions))[0]
