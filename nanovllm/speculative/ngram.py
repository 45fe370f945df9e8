"""The n-gram proposer (prompt lookup): the drafts of a decoding sequence are the tokens that
followed an earlier occurrence of its newest n-gram, found in its own tokens (prompt and
output). No second model: a draft costs a scan of the history, not a forward.

    tokens   ... a b c d e ... x y a b c      newest 3-gram "a b c" (n from max down to min)
                 ^^^^^ ~~~~~                  its latest earlier occurrence, and the k tokens
                       drafts = d e ...       that followed it

The scan over the history is one numpy comparison with the newest token, which finds where it
occurred before (the candidate ends); only those candidates are extended backwards, latest
first, in Python, and a full-length match with k tokens after it ends the search (in a loop, the
first candidate). Each sequence's history is kept as a numpy array and extended by the tokens
appended since its last proposal, so no list is converted per step. (A numpy pass per n over
the candidates, ~20 numpy calls a row, was slower: docs/speculative.md.)"""

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
        return find_drafts(tokens, seq.token_ids, self.min_n, self.max_n, min(self.k, limit))

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


def find_drafts(
    tokens: np.ndarray, token_ids: list[int], min_n: int, max_n: int, k: int
) -> list[int]:
    """The k tokens (or fewer, at the end) after an earlier occurrence of the longest suffix
    n-gram, min_n <= n <= max_n: of its occurrences the one with the most tokens after it (up to
    k), the latest of those. [] if no suffix of min_n tokens occurred before. `tokens` and
    `token_ids` are the same history, as a numpy array (for the scan) and a list."""
    length = len(token_ids)
    if length <= min_n or k <= 0:
        return []
    # Candidate ends e < length - 1 of an earlier match: where the newest token occurred. Each is
    # extended backwards while it matches, latest first; a full match with k tokens after it
    # cannot be beaten, so a loop's latest period usually ends the search at once.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    best_n = best_end = best_after = 0
    for end in reversed(ends.tolist()):
        n = 1
        while n < max_n and n <= end and token_ids[end - n] == token_ids[length - 1 - n]:
            n += 1
        after = min(k, length - 1 - end)
        if (n, after) > (best_n, best_after):
            best_n, best_end, best_after = n, end, after
            if n == max_n and after == k:
                break
    if best_n < min_n:
        return []
    return token_ids[best_end + 1 : best_end + 1 + best_after]
