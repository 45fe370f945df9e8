"""The step loop of speculative decoding (`speculative_config`), chosen once when the engine is
built. Each decoding sequence whose newest n-gram occurred before gets up to k drafts
(speculative/ngram.py, through the loop's SpeculativeScheduler); its row is verified in the
step's one forward, its 1 + d tokens written to the paged cache and each position attending over
the cache up to itself, with logits at every position (ModelRunner.run_verify):

    row:      t   d1  d2  d3        t: its last token; d1..d3: the drafts
    logits:   p0  p1  p2  p3        p_j: the target's distribution after t d1 .. dj
    sampled:  s0  s1  s2  s3        s_j drawn from p_j by the sampler, per position
    taken:    s0 (= d1), s1 (= d2), s2 (!= d3): drafts kept while s_j == d(j+1), then s_j

Greedy, s_j is the argmax: the tokens are those of plain decoding. Sampled, this is rejection
sampling for a draft that is a point mass: the draft is kept with probability p_j(d), and when
s_j != d, s_j is distributed as p_j with d zeroed and renormalised (the residual), so the
output is distributed exactly as the target's. Every position is sampled with its own step's
settings (sampling/verify.py); penalties and structured outputs are refused with speculation
(check()).

A step where no row has drafts is the plain step (CUDA graphs and all)."""

from nanovllm.config import Config
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence
from nanovllm.engine.loop import StepResult, SyncLoop, TakenToken, postprocess, scheduler_limits
from nanovllm.sampling_params import SamplingParams
from nanovllm.speculative.metrics import SpecDecodeStats
from nanovllm.speculative.ngram import NgramProposer
from nanovllm.speculative.scheduler import SpeculativeScheduler


class SpeculativeLoop(SyncLoop):
    scheduler: SpeculativeScheduler

    @staticmethod
    def make_scheduler(block_manager: BlockManager, config: Config) -> SpeculativeScheduler:
        spec = config.speculative_config
        proposer = NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
        return SpeculativeScheduler(block_manager, proposer=proposer, **scheduler_limits(config))

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

    def reset(self) -> None:
        """After a failed step: its sequences were finished (aborted), which forgot their
        drafts' state; the next schedule() starts afresh."""

    def step(self) -> StepResult:
        seqs = self.scheduler.schedule()
        if not self.scheduler.drafts:  # the plain step
            return self.run(seqs)
        return self._speculative_step(seqs)

    def _speculative_step(self, seqs: list[Sequence]) -> StepResult:
        """Plain rows recorded as in the plain step; verified rows through verify()."""
        scheduler, drafts = self.scheduler, self.scheduler.drafts
        plain = [seq for seq in seqs if seq.seq_id not in drafts]
        verified = [seq for seq in seqs if seq.seq_id in drafts]
        num_prefill = sum(seq.num_scheduled_tokens for seq in plain if seq.is_prefill)
        num_plain_decode = len(plain) - sum(seq.is_prefill for seq in plain)
        out = self.runner.run_verify(seqs, drafts)
        accepted = postprocess(scheduler, plain, out.plain) if plain else []
        taken = [TakenToken(seq, seq.last_token, (seq.logprobs or [None])[-1]) for seq in accepted]
        stats = SpecDecodeStats()
        offset = 0
        for seq in verified:
            num_drafts = len(drafts[seq.seq_id])
            rows = range(offset, offset + 1 + num_drafts)
            tokens, num_accepted = scheduler.verify(seq, [out.sampled[i] for i in rows])
            stats.add(SpecDecodeStats(1, num_drafts, num_accepted))
            for row, token_id in zip(rows, tokens):
                entry = None if out.logprobs is None else out.logprobs[row]
                if seq.logprobs is not None:
                    seq.logprobs.append(entry)
                taken.append(TakenToken(seq, token_id, entry))
            offset += 1 + num_drafts
        num_decode = num_plain_decode + len(taken) - len(accepted)
        return StepResult(accepted + verified, num_prefill, num_decode, taken, stats)
