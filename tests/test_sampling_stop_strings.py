"""Stop strings on incrementally decoded text, against the tokenizer's whole-text decode."""

import pytest
from transformers import AutoTokenizer

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import FinishReason, Sequence
from nanovllm.engine.detokenizer import IncrementalDetokenizer, StopStringChecker, find_stop_string
from nanovllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    return AutoTokenizer.from_pretrained(str(checkpoints["gqa"]))


def test_incremental_text_is_the_whole_decode_without_split_characters(tokenizer):
    text = "def naïve(x):\n    return 'café — 日本語 🙂' * x  # done"
    ids = tokenizer.encode(text)
    assert len(ids) > 20 and any("\ufffd" in tokenizer.decode([i]) for i in ids)  # split chars
    detokenizer = IncrementalDetokenizer(tokenizer)
    for n, token_id in enumerate(ids, 1):
        detokenizer.append([token_id])
        assert "\ufffd" not in detokenizer.text
        assert tokenizer.decode(ids[:n]).startswith(detokenizer.text)
    assert detokenizer.text == text


def test_find_stop_string_takes_the_earliest_that_ends_in_the_new_characters():
    assert find_stop_string("hello world", 3, ["rld", "wor"]) == 6  # "wor" ends in the new chars
    assert find_stop_string("hello world", 2, ["wor"]) is None  # ends before them
    assert find_stop_string("hello world", 2, ["hello"]) is None
    assert find_stop_string("abcabc", 1, ["c", "bc"]) == 4
    assert find_stop_string("abc", 3, ["zz"]) is None


def decode_steps(
    checker: StopStringChecker, seq: Sequence, ids: list[int]
) -> tuple[int, str] | None:
    """Feed tokens one step at a time; (tokens fed, text) when a stop string is found."""
    for n, token_id in enumerate(ids, 1):
        seq.append_token(token_id)
        text = checker.check(seq)
        if text is not None:
            return n, text
    return None


def test_a_stop_string_across_tokens_is_found_when_its_last_token_arrives(tokenizer):
    ids = tokenizer.encode("x = compute(value)\nprint(x)")
    params = SamplingParams(stop=["ute(val", "print"])
    n, text = decode_steps(StopStringChecker(tokenizer), Sequence([1], params, 16), ids)
    first_with_stop = next(
        k for k in range(1, len(ids) + 1) if "ute(val" in tokenizer.decode(ids[:k])
    )
    assert (n, text) == (first_with_stop, "x = comp")


def test_stop_strings_do_not_match_before_min_tokens(tokenizer):
    """Through the scheduler, which decides what counts: the checker sees every token."""
    ids = tokenizer.encode("ab ab ab ab ab ab")
    where = [
        k
        for k in range(1, len(ids) + 1)
        if tokenizer.decode(ids[:k]).count("ab") > tokenizer.decode(ids[: k - 1]).count("ab")
    ]
    params = SamplingParams(stop=["ab"], min_tokens=where[1] - 1, max_tokens=len(ids))
    scheduler = Scheduler(
        BlockManager(8, 16),
        max_num_seqs=1,
        max_num_batched_tokens=64,
        max_model_len=64,
        stop_strings=StopStringChecker(tokenizer),
    )
    seq = Sequence([1], params, 16)
    scheduler.add(seq)
    while not seq.is_finished:  # the "model" emits ids in order, one per step
        batch, token = scheduler.schedule(), ids[seq.num_completion_tokens]
        scheduler.postprocess(batch, [token])
    n = seq.num_completion_tokens  # the 2nd "ab" ends after min_tokens
    assert n == where[1] and seq.finish_reason is FinishReason.STOP
    assert seq.stop_text == tokenizer.decode(ids[:n]).rsplit("ab", 1)[0]
    assert seq.seq_id not in scheduler.stop_strings.detokenizers
