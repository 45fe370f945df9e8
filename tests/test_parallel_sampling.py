"""SamplingParams.n: n completions of one prompt whose KV is computed once. The control
plane by plain reasoning (the fake runner, block ref counts), the engine against
transformers and against n separate seeded requests."""

import torch
from conftest import hf_greedy
from fake_runner import FakeRunner, run_until_done, step
from invariants import check_scheduler

from nanovllm import LLM, SamplingParams
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import FinishReason, Sequence

BS = 4


def add_request(scheduler: Scheduler, prompt: list[int], params: SamplingParams) -> list[Sequence]:
    """What LLMEngine.add_request queues: the first sequence, then n - 1 that wait for it."""
    first = Sequence(prompt, params, BS)
    seqs = [first] + [
        Sequence(prompt, params, BS, parent=first, index=i) for i in range(1, params.n)
    ]
    for seq in seqs:
        scheduler.add(seq)
    return seqs


def make_scheduler(prefix_caching: bool = True) -> Scheduler:
    return Scheduler(
        BlockManager(32, BS, enable_prefix_caching=prefix_caching),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=1024,
    )


def test_the_first_sequence_prefills_alone_and_the_others_compute_only_the_uncached_tail():
    sch, runner = make_scheduler(), FakeRunner()
    seqs = add_request(sch, list(range(1, 11)), SamplingParams(n=4, max_tokens=3, ignore_eos=True))
    ids = [seq.seq_id for seq in seqs]
    step(sch, runner)
    assert runner.batches[-1] == ([ids[0]], [10], 0)  # the others wait for its KV
    step(sch, runner)
    # 10 tokens = 2 full blocks (hashed now) + 2: the others compute only those 2
    assert runner.batches[-1] == (ids, [1, 2, 2, 2], 1)
    shared = seqs[0].block_table[:2]
    assert all(seq.block_table[:2] == shared for seq in seqs)
    assert [sch.block_manager.blocks[b].ref_count for b in shared] == [4, 4]
    run_until_done(sch, runner)
    assert sum(n for _, tokens, num_decode in runner.batches for n in tokens[num_decode:]) == 16
    assert sch.block_manager.num_free_blocks == 32


def test_a_prompt_of_whole_blocks_leaves_the_others_only_its_last_token_to_compute():
    sch, runner = make_scheduler(), FakeRunner()
    add_request(sch, list(range(1, 9)), SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    step(sch, runner)
    step(sch, runner)
    assert runner.batches[-1][1] == [1, 1, 1]  # 1 decode + 2 x the last prompt token


def test_without_prefix_caching_the_n_sequences_prefill_together():
    sch, runner = make_scheduler(prefix_caching=False), FakeRunner()
    add_request(sch, list(range(1, 11)), SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    step(sch, runner)
    assert runner.batches[-1][1] == [10, 10, 10]


def test_aborting_a_request_drops_all_its_sequences_and_frees_their_blocks():
    sch, runner = make_scheduler(), FakeRunner()
    other = add_request(sch, [7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    seqs = add_request(sch, list(range(1, 11)), SamplingParams(n=3, max_tokens=50))
    step(sch, runner)
    step(sch, runner)
    assert sch.abort(seqs[0].seq_id) and not sch.abort(seqs[0].seq_id)
    assert all(seq.finish_reason is FinishReason.ABORT and not seq.block_table for seq in seqs)
    assert list(sch.running) == [other]
    check_scheduler(sch)


# -- through the engine ----------------------------------------------------------------


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_n_gives_n_equal_completions_that_match_transformers(checkpoints):
    path, prompt = str(checkpoints["gqa"]), prompt_of(21)
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=32) as llm:
        out = llm.generate(
            [prompt],
            SamplingParams(n=4, temperature=0, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in out.outputs] == [hf_greedy(path, tuple(prompt), 12)] * 4


def test_seeded_n_completions_differ_and_are_the_requests_with_seeds_seed_plus_index(checkpoints):
    prompt = prompt_of(40, seed=1)
    params = SamplingParams(n=8, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    with LLM(str(checkpoints["gqa"]), kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        llm.add_request(prompt, params)
        num_prefill = 0
        while not llm.is_finished():
            num_prefill += llm.step().num_prefill_tokens
        together = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
        apart = [
            o["token_ids"]
            for o in llm.generate(
                [prompt] * 8,
                [
                    SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10, ignore_eos=True)
                    for i in range(8)
                ],
                use_tqdm=False,
            )
        ]
    # 40 tokens: 2 full blocks of 16 shared, each of the other 7 computes the last 8
    assert num_prefill == 40 + 7 * 8
    assert together == apart and len({tuple(t) for t in together}) == 8


def test_step_outputs_of_an_n_request_carry_its_id_and_their_index(checkpoints):
    with LLM(str(checkpoints["gqa"]), kvcache_block_size=16, num_kvcache_blocks=32) as llm:
        request_id = llm.add_request([5, 6, 7], SamplingParams(n=3, max_tokens=4, seed=0))
        finished = []
        while not llm.is_finished():
            finished += llm.step().finished
    assert sorted((o.seq_id, o.index) for o in finished) == [(request_id, i) for i in range(3)]
