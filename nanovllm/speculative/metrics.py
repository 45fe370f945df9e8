"""Speculative decoding's counters, vLLM's: per step in StepOutput.spec_decode, summed since the
engine started in EngineStats.spec_decode, and on the server's /metrics."""

from dataclasses import dataclass


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0  # rows verified with at least one draft
    num_draft_tokens: int = 0  # drafts proposed (and verified)
    num_accepted_tokens: int = 0  # drafts equal to the target's token, up to the first miss

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafts (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified row yields on average: its accepted drafts + the target's own
        (vLLM's "mean acceptance length"; 1 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def add(self, other: "SpecDecodeStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
