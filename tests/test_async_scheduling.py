"""Async scheduling: step n + 1 is scheduled and queued before step n's tokens are read.
The scheduler is driven with a one-step lag against the fake runner (plain Python: it
checks every KV slot a sequence reads), and the engine, on the CPU, must return exactly
what the synchronous engine returns and, greedy, what transformers returns."""

import random

import pytest
from conftest import hf_greedy
from fake_runner import FakeRunner
from invariants import check_blocks, check_scheduler
from test_mixed_steps import prompts

from nanovllm import LLM, SamplingParams
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence
from nanovllm.engine.overlap import PENDING, OverlapScheduler


class DeviceFeedRunner(FakeRunner):
    """The fake runner with the device's feed: a PENDING last token is read from what the
    step before sampled (the host still waits for it)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sampled: dict[int, int] = {}

    def run(self, seqs: list[Sequence]) -> list[int]:
        fed = [seq for seq in seqs if seq.token_ids[-1] == PENDING]
        for seq in fed:
            seq.token_ids[-1] = self.sampled[seq.seq_id]
        tokens = super().run(seqs)
        for seq in fed:
            seq.token_ids[-1] = PENDING
        self.sampled = {seq.seq_id: token for seq, token in zip(seqs, tokens)}
        return tokens


def requests(seed: int, num: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(8)]  # prefix-cache hits among them
    return [
        (
            (shared if rng.random() < 0.5 else [])
            + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))],
            SamplingParams(max_tokens=rng.randrange(1, 25)),
        )
        for _ in range(num)
    ]


def drive(reqs, num_blocks: int, async_scheduling: bool, eos: bool = True):
    """Every request to the end; (completion, finish reason) per request, and the scheduler."""
    scheduler_class = OverlapScheduler if async_scheduling else Scheduler
    scheduler = scheduler_class(
        BlockManager(num_blocks, 4), max_num_seqs=6, max_num_batched_tokens=16, max_model_len=64
    )
    seqs = [Sequence(p, params, 4, eos_token_ids=[0]) for p, params in reqs]
    for seq in seqs:
        scheduler.check_fits(seq.num_prompt_tokens, seq.sampling_params.max_tokens)
        scheduler.add(seq)
    # EOS for some, at a length fixed by the request: the same in both runs
    runner = DeviceFeedRunner(
        eos_after={s.seq_id: len(s) + i % 7 + 2 for i, s in enumerate(seqs) if eos and i % 3 == 0}
    )
    in_flight = None
    for _ in range(2000):
        if scheduler.is_finished():
            break
        batch = scheduler.schedule()
        tokens = runner.run(batch) if batch else []
        if not async_scheduling:
            scheduler.postprocess(batch, tokens)
        else:  # as OverlapLoop.step: launch n + 1, read n, then n + 1's bookkeeping
            if in_flight is not None:
                scheduler.accept(*in_flight)
            scheduler.advance_launched(batch)
            in_flight = (batch, tokens) if batch else None
        check_scheduler(scheduler)
    assert scheduler.is_finished()
    check_blocks(scheduler.block_manager, [])
    assert scheduler.block_manager.num_free_blocks == num_blocks
    return [(s.completion_token_ids, s.finish_reason) for s in seqs], scheduler, runner


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [18, 200])  # 18: preemptions; 200: none
def test_scheduler_with_a_one_step_lag_gives_the_synchronous_results(seed, num_blocks):
    reqs = requests(seed, 14)
    sync, sync_scheduler, _ = drive(reqs, num_blocks, async_scheduling=False)
    lagged, scheduler, runner = drive(reqs, num_blocks, async_scheduling=True)
    assert lagged == sync
    assert PENDING not in [t for tokens, _ in lagged for t in tokens]
    if num_blocks == 18:
        assert scheduler.num_preemptions > 0 and sync_scheduler.num_preemptions > 0


def test_a_sequence_at_its_length_is_not_scheduled_again():
    """Its token in flight is its last: no step computes past max_tokens."""
    _, _, runner = drive(
        [([5, 6, 7], SamplingParams(max_tokens=3))], 20, async_scheduling=True, eos=False
    )
    assert [tokens for _, tokens, _ in runner.batches] == [[3], [1], [1]]


def engine_outputs(path, prompts_, params, **kwargs):
    with LLM(str(path), device="cpu", kvcache_block_size=16, **kwargs) as llm:
        outs = llm.generate(prompts_, params, use_tqdm=False)
        assert llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_blocks
        return [
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs]
            for out in outs
        ], llm.scheduler.num_preemptions


def test_greedy_async_engine_matches_transformers_with_chunked_mixed_steps(checkpoints):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ps = prompts([5, 40, 17, 3, 70], seed=31)
    outs, _ = engine_outputs(
        checkpoints["gqa"],
        ps,
        params,
        async_scheduling=True,
        max_num_batched_tokens=32,
        num_kvcache_blocks=64,
    )
    assert [o[0][0] for o in outs] == [hf_greedy(str(checkpoints["gqa"]), tuple(p), 20) for p in ps]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, n=2, logprobs=2),
        SamplingParams(
            temperature=1.0,
            top_k=20,
            seed=5,
            min_tokens=4,
            max_tokens=30,
            stop=["e", " t"],
            stop_token_ids=[7],
        ),
        SamplingParams(
            temperature=0.7,
            seed=9,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.2,
            max_tokens=20,
        ),
        SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=1, logprobs=1),
        # Read before the next step is queued (penalties count on the host): what ends on
        # those tokens leaves the batch already scheduled (it crashed with emptied blocks).
        SamplingParams(
            temperature=0.7,
            seed=4,
            repetition_penalty=1.3,
            max_tokens=20,
            stop_token_ids=list(range(100, 300)),
        ),
    ],
    ids=[
        "seeded-n2-logprobs",
        "stops-min-tokens",
        "penalties",
        "prompt-logprobs",
        "penalties-stop",
    ],
)
def test_async_engine_returns_what_the_synchronous_engine_returns(checkpoints, params):
    ps = ["the quick brown fox", "a", "jumps over the lazy dog " * 3, "hello world"]
    kwargs = dict(max_num_batched_tokens=24, num_kvcache_blocks=64)
    sync, _ = engine_outputs(checkpoints["gqa"], ps, params, **kwargs)
    lagged, _ = engine_outputs(checkpoints["gqa"], ps, params, async_scheduling=True, **kwargs)
    assert lagged == sync


def test_async_engine_under_preemption_returns_the_synchronous_results(checkpoints):
    params = SamplingParams(temperature=0.9, seed=1, max_tokens=40, ignore_eos=True)
    ps = prompts([20, 9, 33, 14, 25, 7], seed=32)
    kwargs = dict(num_kvcache_blocks=9, max_num_batched_tokens=64)
    sync, sync_preemptions = engine_outputs(checkpoints["gqa"], ps, params, **kwargs)
    lagged, preemptions = engine_outputs(
        checkpoints["gqa"], ps, params, async_scheduling=True, **kwargs
    )
    assert lagged == sync
    assert preemptions > 0 and sync_preemptions > 0


def test_a_request_aborted_while_its_step_runs_frees_its_blocks(checkpoints):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(
        str(checkpoints["gqa"]),
        device="cpu",
        kvcache_block_size=16,
        num_kvcache_blocks=32,
        async_scheduling=True,
    ) as llm:
        keep, drop = llm.add_request([5, 6, 7], params), llm.add_request([8, 9], params)
        for _ in range(3):
            llm.step()
        assert llm.loop.in_flight is not None
        assert llm.abort_request(drop)
        finished = {}
        while not llm.is_finished():
            finished.update({o.seq_id: o for o in llm.step().finished})
        assert list(finished) == [keep]
        assert finished[keep].token_ids == hf_greedy(str(checkpoints["gqa"]), (5, 6, 7), 12)
        assert llm.stats().kv_cache_usage == 0
        check_scheduler(llm.scheduler)


def test_async_scheduling_needs_one_rank(checkpoints):
    with pytest.raises(ValueError, match="async_scheduling works on one rank"):
        LLM(str(checkpoints["gqa"]), device="cpu", async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(TypeError, match="async_scheduling must be True or False"):
        LLM(str(checkpoints["gqa"]), device="cpu", async_scheduling="yes")
