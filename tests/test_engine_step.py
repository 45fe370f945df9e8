"""LLMEngine.step(): what one step reports, by plain counting."""

from nanovllm import LLM, SamplingParams
from nanovllm.engine import EngineStats, StepOutput


def test_an_idle_step_returns_an_empty_step_output_without_running_the_model(checkpoints):
    with LLM(str(checkpoints["gqa"]), device="cpu", num_kvcache_blocks=8) as llm:
        llm.model_runner.run = None  # calling the runner would raise
        assert llm.step() == StepOutput([], num_prefill_tokens=0, num_decode_tokens=0)
        assert llm.is_finished()


def test_a_step_counts_the_prompt_and_decode_tokens_it_computed(checkpoints):
    with LLM(
        str(checkpoints["gqa"]),
        device="cpu",
        num_kvcache_blocks=16,
        kvcache_block_size=16,
        max_num_batched_tokens=32,
    ) as llm:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        llm.add_request(list(range(1, 41)), params)  # 40 tokens: chunks of 32 and 8
        llm.add_request([5, 6, 7], params)
        steps = []
        while not llm.is_finished():
            out = llm.step()
            steps.append((out.num_prefill_tokens, out.num_decode_tokens, len(out.finished)))
    assert steps == [(32, 0, 0), (8 + 3, 0, 0), (0, 2, 0), (0, 2, 2)]


def test_a_step_reports_every_new_token_and_stats_count_the_queues_and_blocks(checkpoints):
    with LLM(
        str(checkpoints["gqa"]),
        device="cpu",
        num_kvcache_blocks=16,
        kvcache_block_size=16,
        max_num_batched_tokens=32,
    ) as llm:
        llm.add_request(
            list(range(1, 41)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        )
        llm.add_request(
            [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2, logprobs=1)
        )
        assert llm.stats() == EngineStats(num_running=0, num_waiting=3, kv_cache_usage=0.0)
        streamed, finished = {}, {}
        first = llm.step()  # a 32-token chunk of the 40-token prompt (3 blocks): no token yet
        assert first.new_tokens == []
        assert llm.stats() == EngineStats(num_running=1, num_waiting=2, kv_cache_usage=3 / 16)
        while not llm.is_finished():
            out = llm.step()
            for token in out.new_tokens:
                streamed.setdefault((token.request_id, token.index), []).append(token)
            finished.update({(o.seq_id, o.index): o for o in out.finished})
        assert llm.stats() == EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0)
    assert streamed.keys() == finished.keys() and len(finished) == 3
    for key, output in finished.items():
        assert [t.token_id for t in streamed[key]] == output.token_ids
        expected = [None] * len(output.token_ids) if output.logprobs is None else output.logprobs
        assert [t.logprobs for t in streamed[key]] == expected
