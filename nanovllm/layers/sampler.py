"""Turns the last-token logits of each sequence into one token id per row."""
import torch
from torch import nn


class Sampler(nn.Module):
    """Per-row temperature: rows with temperature 0 take the argmax; the others sample
    from softmax(logits / T) with the exponential race (argmax of p / E, E ~ Exp(1)),
    which draws exactly from p without a cumulative sum."""

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor,
                all_greedy: bool = False) -> torch.Tensor:
        """logits [num_seqs, vocab]; temperatures [num_seqs] -> token ids [num_seqs].
        `all_greedy` (known on the host) skips the sampling work."""
        logits = logits.float()
        if all_greedy:
            return logits.argmax(dim=-1)
        greedy = temperatures == 0
        # Greedy rows divide by 1, keeping their logits (and argmax) intact.
        probs = torch.softmax(logits / torch.where(greedy, 1.0, temperatures)[:, None], dim=-1)
        noise = torch.empty_like(probs).exponential_(1).clamp_min_(1e-10)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)
