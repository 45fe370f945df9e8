"""The step loop of speculative decoding (`speculative_config`), chosen once when the engine is
built. Each decoding sequence whose newest n-gram occurred before gets up to k drafts
(speculative/ngram.py); its row is verified in the step's one forward, its 1 + d tokens written
to the paged cache and each position attending over the cache up to itself (a decode row each:
DecodeRow), with logits at every position:

    row:      t   d1  d2  d3        t: its last token; d1..d3: the drafts
    logits:   p0  p1  p2  p3        p_j: the target's distribution after t d1 .. dj
    sampled:  s0  s1  s2  s3        s_j drawn from p_j by the sampler, per position
    taken:    s0 (= d1), s1 (= d2), s2 (!= d3): drafts kept while s_j == d(j+1), then s_j

Greedy, s_j is the argmax: the tokens are those of plain decoding. Sampled, this is rejection
sampling for a draft that is a point mass: the draft is kept with probability p_j(d), and when
s_j != d, s_j is distributed as p_j with d zeroed and renormalised (the residual), so the
output is distributed exactly as the target's. Every position is sampled with its own step's
settings (temperature, top-k/p, min-p, logit_bias, min_tokens, seed: a seeded row draws the
noise plain decoding would at that token, so its tokens are the same) and logprobs are taken
per position; penalties and structured outputs are refused with speculation (check()).

A step where no row has drafts is the plain step (CUDA graphs and all)."""

from array import array
from dataclasses import replace
from itertools import accumulate
from typing import TYPE_CHECKING, NamedTuple

import torch

from nanovllm.core.sequence import Sequence
from nanovllm.device import to_device
from nanovllm.runner.step_inputs import prepare_inputs
from nanovllm.sampling.logprobs import LogprobRows, collect_logprobs, raw_logprobs
from nanovllm.sampling.metadata import SamplingMetadataBuilder
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling_params import SamplingParams
from nanovllm.speculative.metrics import SpecDecodeStats
from nanovllm.speculative.ngram import NgramProposer
from nanovllm.speculative.scheduler import SpeculativeScheduler

if TYPE_CHECKING:
    from nanovllm.engine.llm_engine import LLMEngine, NewToken, StepOutput


class Position(NamedTuple):
    """What the sampler reads of a sequence, at one of its verified rows."""

    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]
    num_completion_tokens: int  # before this position's token: its seed step, min_tokens


class SpeculativeLoop:
    def __init__(self, engine: "LLMEngine", new_token: type["NewToken"]):
        """`new_token`: llm_engine's NewToken (passed in: this module is imported by it)."""
        config, plain = engine.config.speculative_config, engine.scheduler
        proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        engine.scheduler = SpeculativeScheduler(
            plain.block_manager,
            proposer=proposer,
            max_num_seqs=plain.max_num_seqs,
            max_num_batched_tokens=plain.max_num_batched_tokens,
            max_model_len=plain.max_model_len,
            policy=plain.policy,
        )
        self.engine, self.new_token = engine, new_token
        self.stats = SpecDecodeStats()  # since the engine started

    def reset(self) -> None:
        """After a failed step: its sequences were finished (aborted), which forgot their
        drafts' state; the next schedule() starts afresh."""

    def spec_decode_stats(self) -> SpecDecodeStats:
        """The drafts since the engine started (EngineStats.spec_decode), a copy."""
        return replace(self.stats)

    @staticmethod
    def check(params: SamplingParams) -> None:
        """Refuse what is not applied per position (make_request calls it)."""
        if params.has_penalties:
            raise ValueError(
                "repetition, presence and frequency penalties are not supported with "
                "speculative decoding; drop them or build the LLM without speculative_config"
            )
        if params.structured_outputs is not None:
            raise ValueError(
                "structured outputs are not supported with speculative decoding; build the "
                "LLM without speculative_config to use them"
            )

    def step(self) -> "StepOutput":
        engine, scheduler = self.engine, self.engine.scheduler
        seqs = scheduler.schedule()
        if not scheduler.drafts:  # the plain step
            num_prefill, num_decode = engine.count_tokens(seqs)
            if not seqs:
                return engine.step_output([], 0, 0)
            out = engine.model_runner.run(seqs)
            scheduler.advance(seqs)
            return engine.step_output(engine.postprocess(seqs, out), num_prefill, num_decode)
        return self._speculative_step(seqs)

    @torch.inference_mode()
    def _speculative_step(self, seqs: list[Sequence]) -> "StepOutput":
        """Plain rows sampled and recorded as in the plain step; verified rows through
        sample_positions() and SpeculativeScheduler.verify()."""
        engine, scheduler, runner = self.engine, self.engine.scheduler, self.engine.model_runner
        drafts = scheduler.drafts
        is_verified = [seq.seq_id in drafts for seq in seqs]
        plain = [seq for seq, v in zip(seqs, is_verified) if not v]
        verified = [seq for seq, v in zip(seqs, is_verified) if v]
        num_prefill = sum(seq.num_scheduled_tokens for seq in plain if seq.is_prefill)
        num_plain_decode = len(plain) - sum(seq.is_prefill for seq in plain)
        # Logits rows: a verified row's every position; a prompt chunk's all while it owes
        # prompt logprobs; else each sequence's last.
        rows = [
            seq.num_scheduled_tokens if v or seq.needs_prompt_logits else 1
            for seq, v in zip(seqs, is_verified)
        ]
        logits = self._forward(seqs)
        plain_logits, verified_logits = split_rows(logits, rows, is_verified)
        taken_by = self._sample_plain(plain, plain_logits) if plain else []
        sampled, entries = sample_positions(
            runner.sampler, runner.sampling_metadata, verified, drafts, verified_logits
        )
        new_tokens, step_stats = self._verify(verified, sampled.tolist(), entries)
        output = engine.step_output(
            taken_by + verified, num_prefill, num_plain_decode + len(new_tokens)
        )
        new_tokens = output.new_tokens[: len(taken_by)] + new_tokens  # several per verified row
        return output._replace(new_tokens=new_tokens, spec_decode=step_stats)

    def _sample_plain(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        """The rows without drafts, sampled and recorded as the plain step does."""
        engine = self.engine
        out = engine.model_runner.sample(seqs, logits)
        out = out._replace(token_ids=out.token_ids.tolist())
        engine.scheduler.advance(seqs)
        return engine.postprocess(seqs, out)

    def _verify(
        self, seqs: list[Sequence], sampled: list[int], entries: list[dict | None] | None
    ) -> tuple[list["NewToken"], SpecDecodeStats]:
        """Each verified sequence's drafts against its sampled tokens; the NewTokens taken and
        the step's counters."""
        scheduler, new_tokens, stats = self.engine.scheduler, [], SpecDecodeStats()
        offset = 0
        for seq in seqs:
            drafts = scheduler.drafts[seq.seq_id]
            mine = sampled[offset : offset + 1 + len(drafts)]
            taken, num_accepted = scheduler.verify(seq, mine)
            stats.num_drafts += 1
            stats.num_draft_tokens += len(drafts)
            stats.num_accepted_tokens += num_accepted
            for j, token_id in enumerate(taken):
                entry = None if entries is None else entries[offset + j]
                if seq.logprobs is not None:
                    seq.logprobs.append(entry)
                new_tokens.append(self.new_token(seq.request_id, seq.index, token_id, entry))
            offset += 1 + len(drafts)
        self.stats.add(stats)
        return new_tokens, stats

    @torch.inference_mode()
    def _forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """The step's forward on every rank, a verified sequence as 1 + d decode rows (rank 0's
        logits: a row each, then each prompt chunk's last or, owing prompt logprobs, all)."""
        runner, drafts = self.engine.model_runner, self.engine.scheduler.drafts
        rows: list[Sequence | DecodeRow] = []
        for seq in seqs:
            if seq.seq_id not in drafts:
                rows.append(seq)
                continue
            start = seq.num_cached_tokens  # its last token's position; the drafts follow
            end = start + 1 + len(drafts[seq.seq_id])
            rows += [DecodeRow(seq.token_ids[p], p + 1, seq.block_table) for p in range(start, end)]
        return runner.call("forward", prepare_inputs(rows, runner.block_size), None)


class DecodeRow(NamedTuple):
    """One position of a verified row, as step_inputs.py reads a decoding sequence: a query at
    position num_tokens - 1 over the cache up to itself. The row's K/V are all stored before
    attention runs, so each position sees the drafts before it: causal attention over the chunk,
    on the decode path (the CPU's C++ decode, CUDA graphs)."""

    last_token: int
    num_tokens: int
    block_table: array
    is_prefill: bool = False
    prompt_logprobs: None = None
    needs_prompt_logits: bool = False


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
