"""The n-gram proposer (prompt lookup): the drafts of a decoding sequence are the tokens that
followed an earlier occurrence of its newest n-gram, found in its own tokens (prompt and
output). No second model: a draft costs a scan of the history, not a forward.

    tokens   ... a b c d e ... x y a b c      newest 3-gram "a b c" (n from max down to min)
                 ^^^^^ ~~~~~                  its latest earlier occurrence, and the k tokens
                       drafts = d e ...       that followed it

The scan is vectorized: one numpy comparison of the whole history with the newest token finds
the candidate ends, then each longer n keeps the candidates whose token n back also matches
(a comparison over the survivors only). Each sequence's history is kept as a numpy array and
extended by the tokens appended since its last proposal, so no list is converted per step."""

import numpy as np

from nanovllm.core.sequence import Sequence


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = num_speculative_tokens, min_n, max_n
        self.histories: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (buffer, length)

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to min(k, limit) drafts to follow seq's tokens; [] when no n-gram of at least
        min_n tokens occurred before."""
        tokens = self._history(seq)
        return find_drafts(tokens, self.min_n, self.max_n, min(self.k, limit))

    def _history(self, seq: Sequence) -> np.ndarray:
        """seq's tokens as int64 [num_tokens], from the kept buffer plus the newest tokens
        (tokens are only ever appended; a draft never enters it)."""
        buffer, length = self.histories.get(seq.seq_id, (np.empty(0, np.int64), 0))
        if seq.num_tokens > len(buffer):
            grown = np.empty(max(2 * len(buffer), seq.num_tokens + 64), np.int64)
            grown[:length] = buffer[:length]
            buffer = grown
        buffer[length : seq.num_tokens] = seq.token_ids[length : seq.num_tokens]
        self.histories[seq.seq_id] = buffer, seq.num_tokens
        return buffer[: seq.num_tokens]

    def forget(self, seq_id: int) -> None:
        self.histories.pop(seq_id, None)


def find_drafts(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The k tokens (or fewer, at the end) after the latest earlier occurrence of the longest
    suffix n-gram, min_n <= n <= max_n, that has k tokens after it; else after the earliest
    (the one with the most after it). [] if no suffix of min_n tokens occurred before."""
    length = len(tokens)
    if length <= min_n or k <= 0:
        return []
    # ends: positions e < length - 1 whose n tokens ending at e equal the newest n tokens.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
    n = 1
    while n < max_n and ends.size:
        longer = ends[ends >= n]
        longer = longer[tokens[longer - n] == tokens[length - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if n < min_n or not ends.size:
        return []
    full = ends[ends + k < length]
    end = full[-1] if full.size else ends[0]
    return tokens[end + 1 : end + 1 + k].tolist()
