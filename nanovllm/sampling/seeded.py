"""Seeded requests (SamplingParams.seed; imported only once a request gives one): a seeded
row's random numbers are a hash of (seed, tokens generated so far, token id), so the same seed
gives the same tokens whatever else is in the batch, and on any device. The draw is the
exponential race, argmax(p / E) with E ~ Exp(1) per token, which draws exactly from p."""

from dataclasses import dataclass
from hashlib import blake2b

import numpy as np
import torch

from nanovllm.core.sequence import Sequence
from nanovllm.sampling.ops import unseeded_noise


@dataclass(slots=True)
class SeededRows:
    """The sampled rows of a batch that have a seed (S of its B rows)."""

    rows: torch.Tensor  # [S] int64
    keys: torch.Tensor  # [S] int64, 32-bit keys (seed_key)
    all_rows: bool  # every sampled row is seeded: no unseeded noise to draw

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, vocab] filtered logits -> [B] token ids; the unseeded rows' noise is random."""
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs) if self.all_rows else unseeded_noise(probs)
        noise[self.rows] = seeded_exponentials(self.keys, probs.shape[1])
        return (probs / noise).argmax(dim=-1)


def seeded_rows(seqs: list[Sequence], sampled: np.ndarray, put) -> SeededRows | None:
    """The rows of `seqs` that are sampled (not greedy) and seeded; None when there are none."""
    rows = [i for i, seq in enumerate(seqs) if sampled[i] and seq.sampling_params.seed is not None]
    if not rows:
        return None
    keys = [seed_key(seqs[i].sampling_params.seed, seqs[i].num_completion_tokens) for i in rows]
    return SeededRows(put(rows), put(keys), len(rows) == int(sampled.sum()))


def seed_key(seed: int, step: int) -> int:
    """The 32-bit key of a seeded row's noise at its `step`-th token: nothing else in the batch."""
    digest = blake2b(f"{seed}:{step}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' 32-bit 'prospector' hash of ints in [0, 2**32), exact in int64 on any device."""
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF  # multipliers < 2**30: every product < 2**62
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & 0xFFFFFFFF
    return x ^ (x >> 15)


def seeded_exponentials(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S] keys -> [S, vocab] Exp(1) noise, the same on every device (integers up to the log)."""
    token_bits = mix32(torch.arange(vocab_size, device=keys.device) ^ 0x9E3779B9)
    bits = mix32(keys[:, None] ^ token_bits)  # [S, vocab]
    # The top 23 bits -> an odd multiple of 2**-24 in (0, 1), exact in float32: 0 < -log(u) < inf.
    u = ((bits >> 9) * 2 + 1).float().mul_(2.0**-24)
    return u.log_().neg_()
