"""Stop strings, found on the CPU side: each such request's completion text is decoded
a few tokens at a time, and after every step the newest characters are searched for
the request's stop strings (vLLM's incremental detokenizer behaves the same way).

    tokens   [ ... decoded ... | context | new ]      decode(context + new) minus
                               ^prefix  ^read         decode(context) = the new text

A token can end inside a multi-byte character (byte-level BPE decodes it to U+FFFD);
its text is held back until a later token completes the character.
"""
from transformers import PreTrainedTokenizerBase

from nanovllm.core.sequence import Sequence


class IncrementalDetokenizer:
    """The text of a growing list of token ids, decoding only the newest ones."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0  # token_ids[prefix_offset:read_offset] = context, already in text
        self.read_offset = 0    # token_ids[read_offset:] are not in text yet

    def append(self, token_ids: list[int]) -> int:
        """Add tokens; returns how many characters of text they completed."""
        self.token_ids.extend(token_ids)
        skip = self.skip_special_tokens
        context = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset],
                                        skip_special_tokens=skip)
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(full) <= len(context) or full.endswith("\ufffd"):
            return 0
        self.text += full[len(context):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return len(full) - len(context)


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> int | None:
    """Where the earliest stop string that ends in the last `num_new_chars` characters
    of `text` begins, or None. (vLLM takes the first in list order; the earliest is
    what makes the text end before every stop string.)"""
    starts = []
    for stop in stops:
        start = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if start >= 0:
            starts.append(start)
    return min(starts, default=None)


class StopStringChecker:
    """One IncrementalDetokenizer per running request that has stop strings."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}

    def check(self, seq: Sequence) -> str | None:
        """Decode `seq`'s new completion tokens; if they complete one of its stop
        strings, return the completion text before it, else None. (Whether a match
        counts, e.g. before min_tokens, is the scheduler's call.)"""
        detokenizer = self.detokenizers.get(seq.seq_id)
        if detokenizer is None:
            detokenizer = self.detokenizers[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, seq.sampling_params.skip_special_tokens)
        start = seq.num_prompt_tokens + len(detokenizer.token_ids)
        num_new_chars = detokenizer.append(seq.token_ids[start:])
        if num_new_chars == 0:
            return None
        stop_at = find_stop_string(detokenizer.text, num_new_chars, seq.sampling_params.stop)
        return None if stop_at is None else detokenizer.text[:stop_at]

    def discard(self, seq_id: int) -> None:
        self.detokenizers.pop(seq_id, None)
