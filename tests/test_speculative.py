"""Speculative decoding in the engine against independent oracles: greedy tokens identical to
transformers' (drafts that hit and miss, chunked prefill, prefix hits on blocks speculation
filled, forced preemption, TP=2), the control plane's invariants after every step, and stop
conditions, seeds, logit_bias, min_tokens and logprobs identical to the plain engine's."""

import pytest
import torch
from conftest import hf_greedy
from invariants import check_scheduler

from nanovllm import LLM, SamplingParams

BLOCK = 16
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
ENGINE = dict(
    device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=64, max_num_batched_tokens=48
)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def looping(seed: int, period: int, repeats: int) -> list[int]:
    """A random pattern repeated: drafts proposed from the prompt itself."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (period,), generator=g).tolist() * repeats


def random_prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drive(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, late: list[list[int]] = ()
) -> tuple[list, list]:
    """add_request / step until idle, the block manager's invariants checked after every step,
    `late` added once the others have decoded 4 steps; the completions in prompt order (late
    ones last) and each step's output."""
    ids = [llm.add_request(p, params) for p in prompts]
    done, steps = {}, []
    while not llm.is_finished() or late:
        if late and len(steps) == 4:
            ids += [llm.add_request(p, params) for p in late]
            late = ()
        steps.append(llm.step())
        check_scheduler(llm.scheduler)
        done.update({o.seq_id: o for o in steps[-1].finished})
    return [done[i] for i in ids], steps


def expected(path, prompts, max_tokens=GREEDY.max_tokens) -> list[list[int]]:
    return [hf_greedy(str(path), tuple(p), max_tokens) for p in prompts]


def accepted_runs(steps, request_id: int) -> list[range]:
    """The completion positions each step gave request_id, for steps that gave it several."""
    runs, position = [], 0
    for step in steps:
        n = sum(1 for t in step.new_tokens if t.request_id == request_id)
        if n > 1:
            runs.append(range(position, position + n))
        position += n
    return runs


@pytest.fixture(scope="module")
def spec_llm(checkpoints):
    with LLM(str(checkpoints["gqa"]), speculative_config=SPEC, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def plain_llm(checkpoints):
    with LLM(str(checkpoints["gqa"]), **ENGINE) as llm:
        yield llm


def test_greedy_tokens_match_transformers_when_drafts_hit_and_miss(spec_llm, checkpoints):
    # Looping prompts make drafts; a random one rarely; the 70-token one arrives while the
    # others decode and is chunked (budget 48) beside their verified rows.
    prompts = [looping(1, 5, 6), looping(2, 9, 4), random_prompt(3, 20), looping(19, 7, 10)]
    before = spec_llm.stats().spec_decode
    outputs, steps = drive(spec_llm, prompts[:3], GREEDY, late=prompts[3:])
    assert [o.token_ids for o in outputs] == expected(checkpoints["gqa"], prompts)
    after = spec_llm.stats().spec_decode
    drafts = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert 0 < accepted < drafts  # some drafts hit, some were rolled back
    assert sum(s.spec_decode.num_accepted_tokens for s in steps if s.spec_decode) == accepted
    assert any(s.num_prefill_tokens and s.spec_decode for s in steps)  # verified beside a chunk
    assert spec_llm.scheduler.block_manager.num_free_blocks == 64  # nothing leaked


def test_prefix_hits_on_blocks_that_speculation_filled_match_transformers(spec_llm, checkpoints):
    first = looping(5, 6, 4)
    (output,), _ = drive(spec_llm, [first], GREEDY)
    # The first request's completion blocks were filled by verified rows and hashed; a prompt
    # that extends it reads their KV from the cache.
    second = first + output.token_ids[:20] + random_prompt(6, 3)
    hits = spec_llm.scheduler.block_manager.num_cache_hit_blocks
    outputs, _ = drive(spec_llm, [second], GREEDY)
    assert spec_llm.scheduler.block_manager.num_cache_hit_blocks - hits == len(second) // BLOCK
    assert [o.token_ids for o in outputs] == expected(checkpoints["gqa"], [second])


def test_forced_preemption_with_rollbacks_matches_transformers(checkpoints):
    prompts = [looping(7, 5, 8), looping(8, 6, 5), random_prompt(9, 25), looping(10, 4, 9)]
    engine = dict(ENGINE, num_kvcache_blocks=8)
    with LLM(str(checkpoints["gqa"]), speculative_config=SPEC, **engine) as llm:
        outputs, _ = drive(llm, prompts, GREEDY)
        assert llm.scheduler.num_preemptions > 0
        assert llm.stats().spec_decode.num_accepted_tokens > 0
    assert [o.token_ids for o in outputs] == expected(checkpoints["gqa"], prompts)


def test_an_abort_between_verified_steps_frees_everything(spec_llm, checkpoints):
    kept, dropped = looping(17, 5, 6), looping(18, 4, 7)
    kept_id = spec_llm.add_request(kept, GREEDY)
    dropped_id = spec_llm.add_request(dropped, GREEDY)
    done, verified = {}, 0
    while not spec_llm.is_finished():
        out = spec_llm.step()
        check_scheduler(spec_llm.scheduler)
        verified += out.spec_decode is not None
        if verified == 2 and dropped_id not in done:
            assert spec_llm.abort_request(dropped_id)
            done[dropped_id] = None
        done.update({o.seq_id: o.token_ids for o in out.finished})
    assert done[kept_id] == expected(checkpoints["gqa"], [kept])[0]
    assert spec_llm.scheduler.block_manager.num_free_blocks == 64


def test_stops_and_limits_inside_an_accepted_run_are_the_plain_engines(spec_llm, plain_llm):
    # A token that first comes in the completion inside an accepted run (not as a run's last
    # token: as an accepted draft). Drafts copy earlier tokens, so the prompt is extended by the
    # model's own output until the loop's earlier occurrences are prompt tokens.
    (free,), _ = drive(spec_llm, [looping(8, 6, 5)], GREEDY)
    for k in range(2, 24):
        prompt = looping(8, 6, 5) + free.token_ids[:k]
        (out,), steps = drive(spec_llm, [prompt], GREEDY)
        completion = out.token_ids
        inside = [
            p
            for run in accepted_runs(steps, out.seq_id)
            for p in run[:-1]
            if completion[p] not in completion[:p]
        ]
        if inside:
            break
    stop_at = inside[0]
    stop_token = completion[stop_at]
    cases = [
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=stop_at + 1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_token], min_tokens=31),
        SamplingParams(
            temperature=0, max_tokens=32, stop=[spec_llm.tokenizer.decode(completion)[-6:]]
        ),
    ]
    for params in cases:
        (spec,), _ = drive(spec_llm, [prompt], params)
        (plain,), _ = drive(plain_llm, [prompt], params)
        assert (spec.token_ids, spec.text, spec.finish_reason, spec.stop_reason) == (
            plain.token_ids,
            plain.text,
            plain.finish_reason,
            plain.stop_reason,
        ), params
    (stopped,), _ = drive(spec_llm, [prompt], cases[0])
    assert len(stopped.token_ids) == stop_at + 1 and stopped.finish_reason == "stop"


def test_seeded_sampling_with_bias_and_min_tokens_is_the_plain_engines(spec_llm, plain_llm):
    # A low temperature over the top 3: the random model's logits are flat, and drafts must be
    # accepted sometimes (and rejected others) for the test to cover both.
    params = SamplingParams(
        temperature=0.1,
        top_k=3,
        seed=123,
        n=2,
        max_tokens=32,
        min_tokens=20,
        logit_bias={445: 0.01},
    )
    prompts = [looping(12, 5, 6), looping(13, 3, 8)]
    before = spec_llm.stats().spec_decode
    spec = [o.outputs for o in spec_llm.generate(prompts, params, use_tqdm=False)]
    after = spec_llm.stats().spec_decode
    drafts = after.num_draft_tokens - before.num_draft_tokens
    assert 0 < after.num_accepted_tokens - before.num_accepted_tokens < drafts
    plain = [o.outputs for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    assert [[c.token_ids for c in o] for o in spec] == [[c.token_ids for c in o] for o in plain]


def test_logprobs_of_accepted_tokens_are_the_plain_engines(spec_llm, plain_llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [looping(14, 5, 6)]
    spec = spec_llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    plain = plain_llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == plain.token_ids
    assert len(spec.logprobs) == len(plain.logprobs) == 24
    for mine, theirs in zip(spec.logprobs, plain.logprobs):
        assert list(mine) == list(theirs)
        for token, logprob in mine.items():
            assert logprob.rank == theirs[token].rank
            assert logprob.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
    assert spec.cumulative_logprob == pytest.approx(plain.cumulative_logprob, abs=1e-3)


def test_penalties_and_structured_outputs_are_refused_and_the_engine_goes_on(spec_llm):
    from nanovllm.structured import StructuredOutputsParams

    with pytest.raises(ValueError, match="penalties.*speculative"):
        spec_llm.generate([[5, 6, 7]], SamplingParams(repetition_penalty=1.2), use_tqdm=False)
    with pytest.raises(ValueError, match="structured outputs.*speculative"):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
        spec_llm.generate([[5, 6, 7]], params, use_tqdm=False)
    out = spec_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 3


def test_a_bad_speculative_config_is_a_value_error_naming_the_key(checkpoints):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(checkpoints["gqa"]), speculative_config={"method": "ngram"}, device="cpu")
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(
            str(checkpoints["gqa"]),
            speculative_config=SPEC,
            async_scheduling=True,
            device="cpu",
        )


@pytest.mark.slow
def test_tensor_parallel_speculation_matches_transformers(checkpoints):
    prompts = [looping(15, 5, 6), random_prompt(16, 12)]
    engine = dict(ENGINE, device="cpu", tensor_parallel_size=2)
    with LLM(str(checkpoints["gqa"]), speculative_config=SPEC, **engine) as llm:
        outputs, _ = drive(llm, prompts, GREEDY)
        assert llm.stats().spec_decode.num_accepted_tokens > 0
    assert [o.token_ids for o in outputs] == expected(checkpoints["gqa"], prompts)


def test_prompt_logprobs_of_a_chunk_beside_verified_rows_are_the_plain_engines(spec_llm, plain_llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    early, late = looping(20, 5, 6), random_prompt(21, 60)  # 60 tokens: chunked (budget 48)
    results = []
    for llm in (spec_llm, plain_llm):
        llm.add_request(early, GREEDY)
        for _ in range(4):  # early decodes (verified rows, with speculation)
            llm.step()
        late_id = llm.add_request(late, params)
        outputs, verified = {}, 0
        while not llm.is_finished():
            out = llm.step()
            verified += out.spec_decode is not None and out.num_prefill_tokens > 0
            outputs.update({int(o.request_id): o for o in out.finished_requests})
        results.append((outputs[late_id], verified))
    (spec, verified), (plain, _) = results
    assert verified > 0  # a chunk owing prompt logprobs beside verified rows
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(spec.prompt_logprobs) == len(plain.prompt_logprobs) == len(late)
    for mine, theirs in zip(spec.prompt_logprobs[1:], plain.prompt_logprobs[1:]):
        assert list(mine) == list(theirs)
        for token, logprob in mine.items():
            assert logprob.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
