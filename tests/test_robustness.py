"""Bad input is refused clearly and changes nothing; failures mid-generate lose nothing;
an engine can be created, used and closed repeatedly without leaking."""

import gc
import os
import weakref

import pytest
from conftest import hf_greedy
from graph_cases import graph_workload
from invariants import check_scheduler
from test_qwen3_parity import GREEDY as PARITY_GREEDY
from test_qwen3_parity import make_prompts

from nanovllm import LLM, SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
GOOD = [[5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def llm(checkpoints):
    # max_model_len 40, and a cache of 4 blocks x 16 = 64 token slots
    with LLM(
        str(checkpoints["gqa"]), kvcache_block_size=BLOCK, num_kvcache_blocks=4, max_model_len=40
    ) as engine:
        yield engine


def assert_idle_and_still_correct(llm, checkpoints):
    assert llm.is_finished()
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    out = llm.generate(GOOD, GREEDY, use_tqdm=False)
    assert out[0]["token_ids"] == hf_greedy(str(checkpoints["gqa"]), tuple(GOOD[0]), 8)


@pytest.mark.parametrize(
    "prompts,exc,message",
    [
        ([[]], ValueError, r"prompt 0: the prompt is empty"),
        ([[1, 2], ""], ValueError, r"prompt 1: the prompt is empty"),
        ([[1, 2], [3, 512]], ValueError, r"prompt 1: token id 512 is outside .*\[0, 512\)"),
        ([[-1]], ValueError, r"prompt 0: token id -1 is outside"),
        ([[1] * 41], ValueError, r"prompt 0: prompt of 41 tokens is longer than max_model_len=40"),
        (None, TypeError, r"prompts must be a list"),
        (3.5, TypeError, r"prompts must be a list"),
        ({"prompt": [1]}, TypeError, r"prompt 0: 'prompt' must be a string, got list"),
        (
            [{"prompt_token_ids": [1], "multi_modal_data": {}}],
            ValueError,
            r"prompt 0: a prompt dict takes 'prompt' .* got keys \['multi_modal_data', ",
        ),
        ([[1], {"prompt_token_ids": [600]}], ValueError, r"prompt 1: token id 600 is outside"),
        ([1, 2, 3], TypeError, r"wrap one tokenized prompt in a list"),
        ([None], TypeError, r"prompt 0: a prompt must be a string or a list of token ids"),
        ([[1.5, 2]], TypeError, r"prompt 0: token ids must be ints"),
        ([[[1, 2]]], TypeError, r"prompt 0: token ids must be ints"),
        ([[True]], TypeError, r"prompt 0: token ids must be ints"),
    ],
)
def test_bad_prompts_are_refused_and_change_nothing(llm, checkpoints, prompts, exc, message):
    with pytest.raises(exc, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_idle_and_still_correct(llm, checkpoints)


def test_one_bad_prompt_rejects_the_whole_list(llm, checkpoints):
    with pytest.raises(ValueError, match="prompt 2"):
        llm.generate([[1, 2], [3, 4], [9999]], GREEDY, use_tqdm=False)
    assert not llm.scheduler.waiting and not llm.scheduler.running
    assert_idle_and_still_correct(llm, checkpoints)


@pytest.mark.parametrize(
    "params,exc,message",
    [
        ([GREEDY, GREEDY], ValueError, r"got 2 sampling params for 1 prompts"),
        ("greedy", TypeError, r"sampling_params must be a SamplingParams"),
        ([None], TypeError, r"prompt 0: sampling params must be a SamplingParams"),
        # ids past the vocabulary would index the logits in the sampler, failing the whole step
        (
            [SamplingParams(stop_token_ids=[3, 512], min_tokens=2)],
            ValueError,
            r"prompt 0: stop_token_ids: token id 512 is outside .*\[0, 512\)",
        ),
        (
            [SamplingParams(logit_bias={7: 1.0, 10**6: -5.0})],
            ValueError,
            r"prompt 0: logit_bias: token id 1000000 is outside",
        ),
    ],
)
def test_bad_sampling_params_are_refused(llm, checkpoints, params, exc, message):
    with pytest.raises(exc, match=message):
        llm.generate(GOOD, params, use_tqdm=False)
    assert_idle_and_still_correct(llm, checkpoints)


def test_prompt_plus_max_tokens_beyond_max_model_len_is_capped(llm, checkpoints):
    prompt = list(range(10, 30))  # 20 tokens; max_model_len 40 leaves room for 20 more
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
    )
    assert out[0]["token_ids"] == hf_greedy(str(checkpoints["gqa"]), tuple(prompt), 20)


def test_a_request_that_can_never_fit_the_cache_is_refused(checkpoints):
    with LLM(str(checkpoints["gqa"]), kvcache_block_size=BLOCK, num_kvcache_blocks=1) as small:
        with pytest.raises(
            ValueError,
            match=r"prompt 0: request needs 2 KV-cache blocks but the "
            r"cache has only 1",
        ):
            small.generate([[1] * 10], SamplingParams(max_tokens=10), use_tqdm=False)
        assert small.is_finished()


def test_add_request_validates_before_queueing(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([])
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.add_request([1, 2], {"temperature": 0})
    assert llm.is_finished()


def test_abort_request_frees_its_blocks_and_the_others_finish(llm, checkpoints):
    keep = llm.add_request(GOOD[0], GREEDY)
    drop = llm.add_request(list(range(20, 50)), GREEDY)
    llm.step()  # both prefilled: both hold blocks
    assert llm.abort_request(drop) and not llm.abort_request(drop)
    assert all(seq.seq_id != drop for seq in llm.scheduler.running)
    check_scheduler(llm.scheduler)
    finished = {}
    while not llm.is_finished():
        finished.update({o.seq_id: o.token_ids for o in llm.step().finished})
    assert finished == {keep: hf_greedy(str(checkpoints["gqa"]), tuple(GOOD[0]), 8)}
    assert llm.scheduler.block_manager.num_free_blocks == 4


@pytest.mark.parametrize("error", [RuntimeError("device fell over"), KeyboardInterrupt()])
def test_generate_that_raises_half_way_leaves_the_engine_usable(
    llm, checkpoints, monkeypatch, error
):
    real_run, calls = llm.model_runner.run, []

    def failing_run(seqs):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return real_run(seqs)

    monkeypatch.setattr(llm.model_runner, "run", failing_run)
    with pytest.raises(type(error)):
        llm.generate([[1, 2, 3], [4, 5, 6, 7]], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_idle_and_still_correct(llm, checkpoints)


def test_many_requests_on_a_tiny_cache_match_transformers(checkpoints):
    # 46 requests of 1 to 79 prompt tokens and 1 to 37 new ones: the workloads of
    # test_cuda_graph and test_qwen3_parity, whose transformers answers are cached by now.
    prompts, params = graph_workload()
    more = make_prompts() + make_prompts([20, 30, 12, 25, 40, 8], seed=7)
    prompts, params = prompts + more, params + [PARITY_GREEDY] * len(more)
    path = str(checkpoints["gqa"])
    with LLM(path, kvcache_block_size=BLOCK, num_kvcache_blocks=8) as tight:  # one or two at once
        squeezed = [o["token_ids"] for o in tight.generate(prompts, params, use_tqdm=False)]
        assert tight.scheduler.num_preemptions > 0
        assert tight.scheduler.block_manager.num_free_blocks == 8
    assert squeezed == [hf_greedy(path, tuple(p), sp.max_tokens) for p, sp in zip(prompts, params)]


def _resources() -> dict[str, int]:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    pid = str(os.getpid())
    children = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children += f.read().rsplit(")", 1)[1].split()[1] == pid
            except OSError:
                pass
    return {
        "rss_kib": int(status["VmRSS"].split()[0]),
        "threads": int(status["Threads"]),
        "fds": len(os.listdir("/proc/self/fd")),
        "children": children,
    }


@pytest.mark.slow
def test_create_use_close_repeatedly_does_not_leak(checkpoints):
    path = str(checkpoints["gqa"])
    samples = []
    for _ in range(6):
        llm = LLM(path, kvcache_block_size=BLOCK, num_kvcache_blocks=2048)  # 16 MiB of KV cache
        llm.generate(GOOD, GREEDY, use_tqdm=False)
        model, kv_cache = (
            weakref.ref(llm.model_runner.model),
            weakref.ref(llm.model_runner.kv_cache),
        )
        llm.close()
        llm.close()  # closing twice is harmless
        assert kv_cache() is None  # released by close() itself
        del llm
        gc.collect()
        assert model() is None  # nothing else holds the engine's model
        samples.append(_resources())
    first, last = samples[1], samples[-1]  # the first round warms caches up
    assert last["threads"] <= first["threads"]
    assert last["fds"] <= first["fds"]
    assert last["children"] <= first["children"]
    assert last["rss_kib"] - first["rss_kib"] < 30 * 1024, samples


def test_a_closed_engine_says_so(checkpoints):
    with LLM(str(checkpoints["gqa"]), num_kvcache_blocks=4) as llm:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(GOOD, GREEDY, use_tqdm=False)


def test_aborting_a_request_with_stop_strings_forgets_its_text_state(llm):
    seq_id = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=8, stop=["zz"]))
    llm.step()
    llm.step()
    assert seq_id in llm.scheduler.stop_strings.detokenizers
    assert llm.abort_request(seq_id)
    assert seq_id not in llm.scheduler.stop_strings.detokenizers and llm.is_finished()
