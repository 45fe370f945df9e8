"""The data plane's side of structured outputs: each constrained sequence's grammar matcher
(xgrammar's GrammarMatcher, keyed by seq_id) and a step's token bitmask. The GrammarMatchers
are a logits hook of rank 0's sampler (sampling/metadata.py's LogitsHook), given it by the engine
with its first constrained request.

A matcher is advanced lazily, as penalties' token counts are: each step that samples a
constrained sequence first feeds its matcher the tokens the sequence took since the last one,
then fills that sequence's row of the bitmask. So it never needs telling what happened in
between: a preempted sequence keeps its tokens (its matcher is where it was), one that
finished (EOS, a stop string, length, abort) is forgotten, and each of a request's n
sequences has its own matcher. A constraint with reasoning_end_token_id starts later: its rows
sample freely, and their matcher sees nothing, until the sequence has taken that token (a
reasoning model's `</think>`); the grammar holds the tokens after it.

    bitmask [B, ceil(vocab / 32)] int32: bit t % 32 of word t // 32 of row r = token t allowed
"""

from dataclasses import dataclass

import torch

from nanovllm.core.sequence import Sequence
from nanovllm.device import to_device
from nanovllm.kernels import cpu_bitmask
from nanovllm.structured.grammars import Grammars


@dataclass(slots=True)
class GrammarMask:
    """A batch's constrained rows and what each may sample."""

    bitmask: torch.Tensor  # [>= B, ceil(vocab / 32)] int32, on the logits' device
    rows: list[int]  # the constrained rows that sample; the others are left alone

    def apply(self, logits: torch.Tensor) -> None:
        """-inf, in place, where a row's grammar forbids the token ([B, vocab] float32). On a
        CPU by kernels/cpu_bitmask.cpp (faster than xgrammar's there, a word at a time:
        docs/structured_output.md), else by xgrammar's kernel (Triton on CUDA)."""
        library = cpu_bitmask.load() if logits.is_cpu else None
        if library is not None:
            rows = torch.tensor(self.rows, dtype=torch.int64)
            cpu_bitmask.apply_bitmask(library, logits, self.bitmask, rows)
        else:
            from xgrammar import apply_token_bitmask_inplace

            apply_token_bitmask_inplace(logits, self.bitmask, indices=self.rows)


@dataclass(slots=True)
class _Tracked:
    seq: Sequence
    matcher: object  # xgrammar.GrammarMatcher
    end_token_id: int | None  # the grammar starts after the first one (None: at once)
    start: int | None = 0  # completion tokens before the grammar's first; None: not yet known
    num_scanned: int = 0  # completion tokens searched for end_token_id
    num_accepted: int = 0  # completion tokens the matcher has taken

    def started(self) -> bool:
        """Whether the grammar holds the sequence's next token: from the first, or once the
        sequence has taken end_token_id (searched for in the tokens it took since)."""
        if self.start is None:
            ids, first = self.seq.token_ids, self.seq.num_prompt_tokens
            try:
                self.start = ids.index(self.end_token_id, first + self.num_scanned) + 1 - first
            except ValueError:
                self.num_scanned = len(ids) - first
        return self.start is not None


class GrammarMatchers:
    def __init__(self, grammars: Grammars, device: torch.device):
        self.grammars, self.device = grammars, device
        self.xgr = grammars.xgr
        self.vocab_size = grammars.tokenizer_info.vocab_size
        self.tracked: dict[int, _Tracked] = {}  # seq_id -> its matcher
        self.batch = self.xgr.BatchGrammarMatcher()  # every row's matcher in one call
        self.bitmask = self.xgr.allocate_token_bitmask(8, self.vocab_size)  # grows: CPU

    def build(self, seqs: list[Sequence]) -> GrammarMask | None:
        """The bitmask of a batch's constrained rows that sample this step; None if none does
        (prompt chunks short of the end sample nothing; finished rows' tokens are dropped)."""
        self._forget_finished()
        sampling = [i for i, seq in enumerate(seqs) if samples_under_grammar(seq)]
        tracked = {i: self.tracked.get(seqs[i].seq_id) or self._track(seqs[i]) for i in sampling}
        rows = [i for i in sampling if tracked[i].started()]
        if not rows:
            return None
        if len(seqs) > len(self.bitmask):
            self.bitmask = self.xgr.allocate_token_bitmask(2 * len(seqs), self.vocab_size)
        entries = [tracked[i] for i in rows]
        self._catch_up(entries)
        matchers = [entry.matcher for entry in entries]
        self.batch.batch_fill_next_token_bitmask(matchers, self.bitmask, rows)
        return GrammarMask(to_device(self.bitmask[: len(seqs)], self.device), rows)

    def _track(self, seq: Sequence) -> _Tracked:
        """A new matcher; its stop tokens are the sequence's (EOS and stop_token_ids): the
        tokens the scheduler ends it on, allowed where the grammar is complete (those of the
        vocabulary: a config may name an EOS id its checkpoint does not have)."""
        compiled = self.grammars.compile(seq.sampling_params.structured_outputs)
        stops = sorted(t for t in seq.stop_token_ids if t < self.vocab_size)
        matcher = self.xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        end = seq.sampling_params.structured_outputs.reasoning_end_token_id
        entry = _Tracked(seq, matcher, end, start=0 if end is None else None)
        self.tracked[seq.seq_id] = entry
        return entry

    def _catch_up(self, entries: list[_Tracked]) -> None:
        """Feed each matcher the tokens its sequence took since it last saw it (those after its
        start): one each, the last step's, but after the first step (none) and a preemption's
        recompute (none), so one batch call a step."""
        behind = [
            (e, e.seq.token_ids[e.seq.num_prompt_tokens + e.start + e.num_accepted :])
            for e in entries
        ]
        while behind := [(entry, new) for entry, new in behind if new]:
            # token ids are >= 0; async scheduling's placeholder for one not read yet is not
            assert all(new[0] >= 0 for _, new in behind), "a token not read yet"
            tokens = [new[0] for _, new in behind]
            accepted = self.batch.batch_accept_token([e.matcher for e, _ in behind], tokens)
            for (entry, _), token, ok in zip(behind, tokens, accepted):
                if not ok:
                    raise RuntimeError(
                        f"sequence {entry.seq.seq_id}: token {token} breaks its grammar, "
                        f"which the bitmask should have prevented"
                    )
                entry.num_accepted += 1
            behind = [(entry, new[1:]) for entry, new in behind]

    def _forget_finished(self) -> None:
        for seq_id in [i for i, entry in self.tracked.items() if entry.seq.is_finished]:
            del self.tracked[seq_id]


def samples_under_grammar(seq: Sequence) -> bool:
    """seq has a grammar and samples a token this step (its chunk reaches its end)."""
    return (
        seq.sampling_params.structured_outputs is not None
        and not seq.is_finished
        and seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens
    )
