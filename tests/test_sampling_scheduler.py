"""Stop conditions in the control plane, checked by plain reasoning with the fake runner
(which emits 1000 + len(seq), or EOS once a sequence reaches a set length)."""

from fake_runner import FakeRunner, run_until_done, step

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import FinishReason, Sequence
from nanovllm.sampling_params import SamplingParams

BS = 4
EOS = 0


def make_scheduler(max_model_len=1024, stop_strings=None) -> Scheduler:
    return Scheduler(
        BlockManager(32, BS, enable_prefix_caching=True),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=max_model_len,
        stop_strings=stop_strings,
    )


def add(scheduler: Scheduler, prompt=(1, 2, 3), **params) -> Sequence:
    seq = Sequence(list(prompt), SamplingParams(**params), BS, [EOS])
    scheduler.add(seq)
    return seq


def test_a_stop_token_id_ends_the_sequence_and_frees_its_blocks_that_step():
    sch, runner = make_scheduler(), FakeRunner()
    a = add(sch, max_tokens=10, stop_token_ids=[1005])
    b = add(sch, prompt=(7, 8), max_tokens=10, ignore_eos=True)
    finished = []
    while not finished:
        finished = step(sch, runner)
    assert finished == [a] and a.finish_reason is FinishReason.STOP
    assert a.completion_token_ids == [1003, 1004, 1005]  # the stop token is kept
    assert not a.block_table and a not in sch.running
    bm = sch.block_manager
    assert bm.num_blocks - bm.num_free_blocks == len(b.block_table)


def test_min_tokens_delays_eos_and_stop_ids():
    sch = make_scheduler()
    early = add(sch, max_tokens=10)
    delayed = add(sch, prompt=(4, 5, 6), max_tokens=10, min_tokens=3)
    delayed_stop_id = add(
        sch, prompt=(7, 8, 9), max_tokens=10, min_tokens=2, ignore_eos=True, stop_token_ids=[EOS]
    )
    # Every sequence's every token is EOS.
    run_until_done(
        sch, FakeRunner(eos_after={s.seq_id: 4 for s in (early, delayed, delayed_stop_id)})
    )
    assert early.completion_token_ids == [EOS]
    assert delayed.completion_token_ids == [EOS] * 4
    assert delayed_stop_id.completion_token_ids == [EOS] * 3
    assert all(s.finish_reason is FinishReason.STOP for s in (early, delayed, delayed_stop_id))


def test_length_reasons_and_a_stop_token_outranks_the_length_cap():
    sch = make_scheduler(max_model_len=8)
    by_max_tokens = add(sch, max_tokens=2)
    by_model_len = add(sch, prompt=(1, 2, 3, 4, 5), max_tokens=50)
    both = add(sch, prompt=(9, 9, 9), max_tokens=3, stop_token_ids=[1005])  # 3rd token is 1005
    run_until_done(sch, FakeRunner())
    assert (
        by_max_tokens.finish_reason is FinishReason.LENGTH
        and by_max_tokens.num_completion_tokens == 2
    )
    assert by_model_len.finish_reason is FinishReason.LENGTH and len(by_model_len) == 8
    assert both.finish_reason is FinishReason.STOP and both.completion_token_ids[-1] == 1005


class TokenStops:
    """A stop-string checker by plain reasoning: "1006" stops at token 1006; the text
    is the completion's ids before it, space-separated."""

    def __init__(self):
        self.discarded: list[int] = []

    def check(self, seq: Sequence) -> str | None:
        *before, newest = seq.completion_token_ids
        return " ".join(map(str, before)) if str(newest) in seq.sampling_params.stop else None

    def discard(self, seq_id: int) -> None:
        self.discarded.append(seq_id)


def test_a_stop_string_ends_a_running_sequence_that_step_and_frees_its_blocks():
    sch, runner = make_scheduler(stop_strings=TokenStops()), FakeRunner()
    a = add(sch, max_tokens=20, ignore_eos=True, stop=["1006"])  # tokens 1003, 1004, ...
    b = add(sch, prompt=(4, 5, 6, 7, 8), max_tokens=20, ignore_eos=True)
    for _ in range(3):
        assert step(sch, runner) == []
    assert step(sch, runner) == [a]
    assert a.finish_reason is FinishReason.STOP and a.stop_text == "1003 1004 1005"
    assert (
        not a.block_table and list(sch.running) == [b] and sch.stop_strings.discarded == [a.seq_id]
    )
    run_until_done(sch, runner)
    assert b.num_completion_tokens == 20 and a.completion_token_ids[-1] == 1006


def test_a_stop_string_outranks_the_length_cap_and_waits_for_min_tokens():
    sch = make_scheduler(stop_strings=TokenStops())
    on_the_last_token = add(sch, max_tokens=4, stop=["1006"])
    too_early = add(sch, prompt=(7, 7, 7), max_tokens=4, min_tokens=2, stop=["1004"])
    run_until_done(sch, FakeRunner())
    assert on_the_last_token.finish_reason is FinishReason.STOP
    assert too_early.finish_reason is FinishReason.LENGTH and too_early.num_completion_tokens == 4
