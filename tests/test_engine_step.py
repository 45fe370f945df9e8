"""LLMEngine.step(): what one step reports, by plain counting."""
from nanovllm import LLM, SamplingParams
from nanovllm.engine import StepOutput


def test_an_idle_step_returns_an_empty_step_output_without_running_the_model(checkpoints):
    with LLM(str(checkpoints["gqa"]), device="cpu", num_kvcache_blocks=8) as llm:
        llm.model_runner.run = None  # calling the runner would raise
        assert llm.step() == StepOutput([], num_prefill_tokens=0, num_decode_tokens=0)
        assert llm.is_finished()


def test_a_step_counts_the_prompt_and_decode_tokens_it_computed(checkpoints):
    with LLM(str(checkpoints["gqa"]), device="cpu", num_kvcache_blocks=16, kvcache_block_size=16,
             max_num_batched_tokens=32) as llm:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        llm.add_request(list(range(1, 41)), params)  # 40 tokens: chunks of 32 and 8
        llm.add_request([5, 6, 7], params)
        steps = []
        while not llm.is_finished():
            out = llm.step()
            steps.append((out.num_prefill_tokens, out.num_decode_tokens, len(out.finished)))
    assert steps == [(32, 0, 0), (8 + 3, 0, 0), (0, 2, 0), (0, 2, 2)]
