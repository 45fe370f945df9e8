"""Scheduler: prefill/decode batches, chunked prefill, preemption and whole
lifecycles, driven by a fake runner and checked by plain Python reasoning."""

import pytest
from fake_runner import FakeRunner, run_until_done, step

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

BS = 4
EOS = 0


def make_scheduler(
    num_blocks=64,
    max_num_seqs=16,
    max_num_batched_tokens=64,
    max_model_len=1024,
    prefix_caching=True,
    policy="mixed",
) -> Scheduler:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
    return Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy,
    )


def add(scheduler: Scheduler, tokens: list[int], max_tokens=4, ignore_eos=False) -> Sequence:
    s = Sequence(tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), BS, [EOS])
    scheduler.add(s)
    return s


def test_prefill_runs_before_decode_and_each_decode_step_adds_one_token():
    sch, runner = make_scheduler(), FakeRunner()
    a = add(sch, [1, 2, 3], max_tokens=3)
    b = add(sch, [4, 5, 6, 7, 8], max_tokens=3)
    step(sch, runner)
    assert runner.batches[0] == ([a.seq_id, b.seq_id], [3, 5], 0)
    assert a.num_completion_tokens == 1 and not a.is_prefill
    step(sch, runner)
    assert runner.batches[1] == ([a.seq_id, b.seq_id], [1, 1], 2)
    run_until_done(sch, runner)
    assert a.completion_token_ids == [1003, 1004, 1005]
    assert a.is_finished and b.is_finished


def test_decoding_sequences_get_their_token_while_a_long_prompt_is_chunked_beside_them():
    sch, runner = make_scheduler(max_num_batched_tokens=8), FakeRunner()
    a = add(sch, [1, 2, 3], max_tokens=6, ignore_eos=True)
    b = add(sch, [4, 5], max_tokens=6, ignore_eos=True)
    step(sch, runner)  # both prompts: 5 tokens
    long = add(sch, list(range(10, 24)), max_tokens=2)  # 14 tokens arrive while a, b decode
    for _ in range(3):
        step(sch, runner)
    # each step: a and b decode first (2 tokens), the chunk takes the other 6 of the 8
    assert runner.batches[1:] == [
        ([a.seq_id, b.seq_id, long.seq_id], [1, 1, 6], 2),
        ([a.seq_id, b.seq_id, long.seq_id], [1, 1, 6], 2),
        ([a.seq_id, b.seq_id, long.seq_id], [1, 1, 2], 2),
    ]
    assert long.num_completion_tokens == 1 and a.num_completion_tokens == 4
    step(sch, runner)
    assert runner.batches[-1] == ([a.seq_id, b.seq_id, long.seq_id], [1, 1, 1], 3)


def test_prefill_first_stalls_decoding_while_a_prompt_is_chunked():
    sch, runner = make_scheduler(max_num_batched_tokens=8, policy="prefill_first"), FakeRunner()
    a = add(sch, [1, 2, 3], max_tokens=6, ignore_eos=True)
    step(sch, runner)
    long = add(sch, list(range(10, 24)), max_tokens=2)
    for _ in range(3):
        step(sch, runner)
    # nano-vLLM's order: the prompt's chunks run alone, then everyone decodes
    assert runner.batches[1:] == [
        ([long.seq_id], [8], 0),
        ([long.seq_id], [6], 0),
        ([a.seq_id, long.seq_id], [1, 1], 2),
    ]


def test_decode_tokens_take_the_budget_first_and_a_prompt_waits_for_what_is_left():
    sch, runner = make_scheduler(max_num_batched_tokens=3), FakeRunner()
    seqs = [add(sch, [i + 1], max_tokens=4, ignore_eos=True) for i in range(3)]
    step(sch, runner)  # three 1-token prompts fill the budget
    late = add(sch, [9, 9], max_tokens=1)
    step(sch, runner)  # three decode tokens: nothing left for the prompt
    assert runner.batches[1] == ([s.seq_id for s in seqs], [1, 1, 1], 3)
    assert late.status == SequenceStatus.WAITING
    run_until_done(sch, runner)
    assert late.num_completion_tokens == 1


def test_prefill_batch_respects_max_num_seqs():
    sch, runner = make_scheduler(max_num_seqs=2), FakeRunner()
    seqs = [add(sch, [i + 1] * 3) for i in range(3)]
    step(sch, runner)
    assert runner.batches[0][0] == [seqs[0].seq_id, seqs[1].seq_id]
    assert seqs[2].status == SequenceStatus.WAITING
    run_until_done(sch, runner)
    assert all(len(b[0]) <= 2 for b in runner.batches)


def test_chunked_prefill_schedules_exact_chunks_across_steps():
    sch, runner = make_scheduler(max_num_batched_tokens=8), FakeRunner()
    long = add(sch, list(range(1, 21)), max_tokens=2)  # 20 tokens, budget 8
    step(sch, runner)
    assert long.num_cached_tokens == 8 and long.is_prefill and long.num_completion_tokens == 0
    step(sch, runner)
    assert long.num_cached_tokens == 16 and long.num_completion_tokens == 0
    step(sch, runner)
    assert long.num_completion_tokens == 1 and not long.is_prefill
    assert [b[1] for b in runner.batches] == [[8], [8], [4]]
    assert [b[2] for b in runner.batches] == [0, 0, 0]
    run_until_done(sch, runner)
    assert long.completion_token_ids == [1020, 1021]


def test_chunk_shares_the_budget_with_newly_admitted_prompts():
    sch, runner = make_scheduler(max_num_batched_tokens=8), FakeRunner()
    a = add(sch, list(range(1, 11)))  # 10 tokens
    b = add(sch, [50, 51, 52])
    step(sch, runner)  # a: 8
    step(sch, runner)  # a: last 2, then b: 3
    assert runner.batches[1] == ([a.seq_id, b.seq_id], [2, 3], 0)


def test_budget_counts_only_uncached_tokens():
    sch, runner = make_scheduler(max_num_batched_tokens=6), FakeRunner()
    prefix = list(range(1, 13))  # three full blocks
    first = add(sch, prefix + [99], max_tokens=1)
    run_until_done(sch, runner)
    second = add(sch, prefix + [98], max_tokens=1)
    third = add(sch, [77, 78, 79, 80, 81], max_tokens=1)
    runner.batches.clear()
    step(sch, runner)
    # second has 12 cached tokens and needs just 1; the rest of the budget goes to third.
    assert runner.batches[0] == ([second.seq_id, third.seq_id], [1, 5], 0)
    assert first.is_finished


def test_fully_cached_prompt_schedules_one_token():
    sch, runner = make_scheduler(), FakeRunner()
    prompt = list(range(1, 9))  # exactly two blocks
    add(sch, prompt, max_tokens=1)
    run_until_done(sch, runner)
    again = add(sch, prompt, max_tokens=2)
    runner.batches.clear()
    step(sch, runner)
    assert runner.batches[0] == ([again.seq_id], [1], 0)
    run_until_done(sch, runner)
    assert again.completion_token_ids == [1008, 1009]


def test_preemption_picks_the_newest_running_sequence_and_it_completes_later():
    # 4 blocks of 4 tokens: two 4-token prompts take one block each, decoding takes
    # the other two, and at length 9 both need a third block that does not exist.
    sch, runner = make_scheduler(num_blocks=4, max_num_batched_tokens=16), FakeRunner()
    a = add(sch, [1, 2, 3, 4], max_tokens=7, ignore_eos=True)
    b = add(sch, [5, 6, 7, 8], max_tokens=7, ignore_eos=True)
    step(sch, runner)  # prefill a, b -> 1 token each (len 5)
    step(sch, runner)  # decode: each needs a second block -> 4 blocks used
    assert sch.block_manager.num_free_blocks == 0
    for _ in range(3):
        step(sch, runner)  # decode len 6..8, still 2 blocks each
    # len 9 needs a third block each: b (newest) is preempted to make room for a.
    step(sch, runner)
    assert b.status == SequenceStatus.WAITING and not b.block_table and b.is_prefill
    assert sch.waiting[0] is b and list(sch.running) == [a]
    run_until_done(sch, runner)
    assert a.completion_token_ids == list(range(1004, 1011))
    assert b.completion_token_ids == list(range(1004, 1011))
    assert sch.block_manager.num_free_blocks == 4


def test_a_preempted_sequence_runs_again_before_requests_that_were_waiting_longer():
    # As above, but max_num_seqs=2 keeps c waiting from the start. When b is preempted it
    # goes back to the front of the queue, ahead of c, although c has waited longer.
    sch, runner = (
        make_scheduler(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=16),
        FakeRunner(),
    )
    a = add(sch, [1, 2, 3, 4], max_tokens=7, ignore_eos=True)
    b = add(sch, [5, 6, 7, 8], max_tokens=7, ignore_eos=True)
    c = add(sch, [9, 10, 11], max_tokens=2, ignore_eos=True)  # would fit beside a: one block
    for _ in range(6):
        step(sch, runner)  # prefill a and b, then five decode steps: the fifth preempts b
    assert sch.num_preemptions == 1 and b.status == SequenceStatus.WAITING
    assert [s.seq_id for s in sch.waiting] == [b.seq_id, c.seq_id]
    run_until_done(sch, runner)
    runs_of = {
        s.seq_id: [i for i, batch in enumerate(runner.batches) if s.seq_id in batch[0]]
        for s in (b, c)
    }
    resumed = next(i for i in runs_of[b.seq_id] if i >= 6)
    # c did not slip into the block a left free: it starts only with b, after it.
    assert runs_of[c.seq_id][0] == resumed
    assert runner.batches[resumed][0].index(b.seq_id) < runner.batches[resumed][0].index(c.seq_id)
    assert [s.num_completion_tokens for s in (a, b, c)] == [7, 7, 2]


def test_a_sequence_alone_that_cannot_grow_preempts_itself_rather_than_hang():
    sch, runner = make_scheduler(num_blocks=2), FakeRunner()
    a = add(sch, [1, 2, 3, 4], max_tokens=5, ignore_eos=True)  # 8 tokens of KV: 2 blocks
    run_until_done(sch, runner)
    assert a.num_completion_tokens == 5


def test_eos_finishes_a_sequence_and_frees_its_blocks():
    sch = make_scheduler()
    a = add(sch, [1, 2, 3], max_tokens=10)
    runner = FakeRunner(eos_after={a.seq_id: 6})
    run_until_done(sch, runner)
    assert a.completion_token_ids == [1003, 1004, EOS]
    assert sch.block_manager.num_free_blocks == sch.block_manager.num_blocks


def test_ignore_eos_keeps_going():
    sch = make_scheduler()
    a = add(sch, [1, 2, 3], max_tokens=5, ignore_eos=True)
    run_until_done(sch, FakeRunner(eos_after={a.seq_id: 5}))
    assert a.num_completion_tokens == 5 and a.completion_token_ids[-1] == EOS


def test_generation_stops_at_max_model_len():
    sch = make_scheduler(max_model_len=10)
    a = add(sch, [1, 2, 3, 4, 5, 6], max_tokens=100)
    run_until_done(sch, FakeRunner())
    assert len(a) == 10


def test_a_request_that_can_never_fit_is_refused_before_it_is_queued():
    sch = make_scheduler(num_blocks=2)
    with pytest.raises(ValueError, match="KV-cache blocks"):  # 9 tokens need 3 blocks
        sch.check_fits(9, max_tokens=1)
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(max_model_len=8).check_fits(9, SamplingParams().max_tokens)
    assert sch.is_finished()


def test_an_idle_scheduler_schedules_nothing():
    sch = make_scheduler()
    assert sch.schedule() == []


def test_scripted_workload_keeps_integrity_and_frees_every_block():
    sch = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=10)
    runner = FakeRunner()
    shared = list(range(1, 9))
    seqs = [
        add(sch, shared + [100 + i] * (i % 5), max_tokens=3 + i % 4, ignore_eos=True)
        for i in range(10)
    ]
    steps = run_until_done(sch, runner)  # step() checks integrity after every step
    assert all(s.num_completion_tokens == 3 + i % 4 for i, s in enumerate(seqs))
    bm = sch.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert steps < 100
    assert bm.num_cache_hit_blocks > 0
