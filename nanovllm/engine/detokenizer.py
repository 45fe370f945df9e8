"""Text as it grows, token by token: for stop strings (imported with the first request that has
some) and for the server's streams. A completion is decoded a few tokens at a time (as vLLM's
incremental detokenizer does) and each step's new characters are searched.

    tokens   [ ... decoded ... | context | new ]      decode(context + new) minus
                               ^prefix  ^read         decode(context) = the new text

A token ending inside a multi-byte character (U+FFFD) is held back until a later one ends it."""

from functools import partial

from transformers import PreTrainedTokenizerBase

from nanovllm.core.sequence import Sequence


class IncrementalDetokenizer:
    """The text of a growing list of token ids, decoding only the newest ones."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = False):
        self.decode = partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0  # token_ids[prefix_offset:read_offset] = context, already in text
        self.read_offset = 0  # token_ids[read_offset:] are not in text yet

    def append(self, token_ids: list[int]) -> int:
        """Add tokens; returns how many characters of text they completed."""
        self.token_ids.extend(token_ids)
        context = self.decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(context) or full.endswith("\ufffd"):
            return 0
        self.text += full[len(context) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return len(full) - len(context)


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> int | None:
    """Where the earliest stop string ending in the last `num_new_chars` characters of `text`
    begins, or None (the earliest, not vLLM's first listed: the text ends before every one)."""
    starts = [text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1)) for stop in stops]
    return min((start for start in starts if start >= 0), default=None)


class StopStringChecker:
    """One IncrementalDetokenizer per running request that has stop strings."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}

    def check(self, seq: Sequence) -> str | None:
        """The completion text before a stop string seq's new tokens complete, or None."""
        detokenizer = self.detokenizers.get(seq.seq_id)
        if detokenizer is None:
            detokenizer = self.detokenizers[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, seq.sampling_params.skip_special_tokens
            )
        start = seq.num_prompt_tokens + len(detokenizer.token_ids)
        num_new_chars = detokenizer.append(seq.token_ids[start:])
        stop_at = find_stop_string(detokenizer.text, num_new_chars, seq.sampling_params.stop)
        return None if stop_at is None else detokenizer.text[:stop_at]

    @staticmethod
    def completion_text(seq: Sequence, text: str) -> tuple[str, str | None]:
        """A completion ended by a stop string: its text and the stop string (vLLM's
        stop_reason), found again at the end of seq.stop_text in the whole decoded `text`."""
        params = seq.sampling_params
        stop = next((s for s in params.stop if text.startswith(s, len(seq.stop_text))), None)
        kept = (stop or "") if params.include_stop_str_in_output else ""
        return seq.stop_text + kept, stop

    def discard(self, seq_id: int) -> None:
        self.detokenizers.pop(seq_id, None)
