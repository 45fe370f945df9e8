"""Tensor parallelism on the CPU: 2 ranks over gloo. The same greedy tokens as one rank
and as `transformers`; worker processes that fail loudly and leave nothing behind.

Spawning a rank costs seconds (it imports torch), so each engine serves a few asserts."""

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from time import monotonic

import pytest
import torch
from arrivals import mixed_steps, run_with_arrivals
from test_qwen3_parity import BLOCK, GREEDY, expected, generate, make_prompts

from nanovllm import LLM
from nanovllm.demo import build_tiny_qwen3
from nanovllm.distributed.group import TPGroup, tp_group_scope
from nanovllm.layers.embed_head import VocabParallelEmbedding
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

TP2 = dict(tensor_parallel_size=2, kvcache_block_size=BLOCK)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def biased_tied(tmp_path_factory) -> Path:
    """Heads 4 / KV heads 2 with attention biases and a tied LM head: with 2 ranks, every
    sharded layer kind and both bias kinds (sharded QKV, once-added o_proj). Its layers are
    drawn wider than its embedding, as conftest's tied "mqa", so its greedy output varies."""
    return build_tiny_qwen3(
        tmp_path_factory.mktemp("tp") / "biased_tied",
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        attention_bias=True,
        layer_initializer_range=0.24,
        seed=1,
    )


def worker_processes(llm: LLM) -> list:
    return list(llm.model_runner.workers.processes)


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def is_running_not_zombie(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def shared_memory_files(pid: int) -> set[str]:
    """/dev/shm files that process `pid` has mapped or open and that would outlive it
    (not yet unlinked; multiprocessing unlinks its semaphores at once)."""
    maps = [line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()]
    fds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # closed meanwhile (the listing's own descriptor)
            pass
    return {path for path in maps + fds if path.startswith("/dev/shm/") and os.path.exists(path)}


def raises_within(seconds: float, fn) -> BaseException:
    """Run `fn` in a thread; fail unless it raises within `seconds` (a hang fails too)."""
    outcome: list = []

    def target():
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # the test inspects it
            outcome.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still running after {seconds} s"
    assert outcome[0] is not None, "returned instead of raising"
    return outcome[0]


@pytest.mark.slow
def test_two_tp2_engines_at_once_match_transformers_and_tp1_then_close_cleanly(
    checkpoints, biased_tied
):
    paths = [checkpoints["gqa"], biased_tied]
    prompts = make_prompts()  # test_qwen3_parity's: transformers' answers are cached
    engines = [LLM(str(path), num_kvcache_blocks=128, **TP2) for path in paths]
    try:
        workers = [p for llm in engines for p in worker_processes(llm)]
        pids = [os.getpid()] + [p.pid for p in workers]
        outputs = [generate(llm, prompts) for llm in engines]
        assert outputs == [expected(path, prompts) for path in paths]
        with LLM(str(biased_tied), num_kvcache_blocks=128, kvcache_block_size=BLOCK) as tp1:
            assert generate(tp1, prompts) == outputs[1]
        assert not [f for pid in pids for f in shared_memory_files(pid)]
    finally:
        for llm in engines:
            llm.close()
    assert [p.exitcode for p in workers] == [0, 0]  # left their loop and exited cleanly
    assert not [p for p in workers if is_running(p.pid)]


@pytest.mark.slow
def test_chunked_prefill_and_preemption_match_then_deleting_the_llm_stops_its_workers(checkpoints):
    path = checkpoints["gqa"]
    prompts = make_prompts([20, 30, 12, 25, 40, 8], seed=7)  # test_qwen3_parity's: cached
    llm = LLM(str(path), num_kvcache_blocks=10, max_num_batched_tokens=24, **TP2)
    assert generate(llm, prompts) == expected(path, prompts)
    assert llm.scheduler.num_preemptions > 0
    early, late = prompts[:2], prompts[2:5]  # mixed steps: these arrive while those decode
    tokens, steps = run_with_arrivals(llm, early, late, GREEDY)
    assert tokens == expected(path, early + late) and mixed_steps(steps) >= 1
    workers = worker_processes(llm)
    del llm
    gc.collect()
    assert [p.exitcode for p in workers] == [0]
    assert not is_running(workers[0].pid)


@pytest.mark.slow
def test_a_worker_ignores_ctrl_c_but_a_killed_one_makes_the_next_generate_raise(checkpoints):
    path = checkpoints["gqa"]
    prompts = make_prompts([5, 20], seed=13)
    with LLM(str(path), num_kvcache_blocks=32, **TP2) as llm:
        worker = worker_processes(llm)[0]
        os.kill(worker.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches every process
        assert generate(llm, prompts) == expected(path, prompts)
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = monotonic()
        error = raises_within(10, lambda: generate(llm, [[1, 2, 3]]))
        assert isinstance(error, RuntimeError) and "worker rank 1" in str(error)
        assert monotonic() - start < 5
        error = raises_within(10, lambda: generate(llm, [[1, 2, 3]]))  # and stays an error
        assert isinstance(error, RuntimeError)


@pytest.mark.slow
def test_a_worker_killed_mid_generate_makes_it_raise_within_seconds(checkpoints):
    with LLM(str(checkpoints["gqa"]), num_kvcache_blocks=128, **TP2) as llm:
        worker = worker_processes(llm)[0]
        threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
        long_run = make_prompts([40] * 8, seed=12)
        error = raises_within(15, lambda: [generate(llm, long_run) for _ in range(100)])
        assert isinstance(error, RuntimeError) and "worker rank 1" in str(error), error


@pytest.mark.slow
def test_a_step_that_fails_on_rank_0_leaves_the_engine_refusing_to_run(checkpoints):
    class Interrupted(Exception):
        pass

    def interrupted(*args):
        raise Interrupted  # the worker, meanwhile, waits in the step's first collective

    llm = LLM(str(checkpoints["gqa"]), num_kvcache_blocks=32, **TP2)
    worker = worker_processes(llm)[0]
    llm.model_runner.forward = interrupted  # runs after the workers got the step's inputs
    with pytest.raises(Interrupted):
        generate(llm, [[1, 2, 3]])
    with pytest.raises(RuntimeError, match="out of step"):
        generate(llm, [[1, 2, 3]])
    start = monotonic()
    llm.close()
    assert monotonic() - start < 3 and not is_running(worker.pid)  # not stuck in its collective


@pytest.mark.slow
@pytest.mark.parametrize("end", ["exit without close", "killed"])
def test_workers_end_with_the_callers_process(checkpoints, end):
    last_line = "os.kill(os.getpid(), signal.SIGKILL)" if end == "killed" else "pass"
    script = (
        "import os, signal\n"
        "from nanovllm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(checkpoints['gqa'])!r}, tensor_parallel_size=2,"
        " num_kvcache_blocks=8)\n"
        "    print(*[p.pid for p in llm.model_runner.workers.processes], flush=True)\n"
        f"    {last_line}\n"
    )
    cwd = Path(checkpoints["gqa"]).parent
    (cwd / "tp_end.py").write_text(script)
    result = subprocess.run(
        [sys.executable, "tp_end.py"], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    pids = [int(pid) for pid in result.stdout.split()]
    assert pids, result.stderr[-3000:]
    if end == "killed":
        assert result.returncode == -signal.SIGKILL
        deadline = monotonic() + 10  # orphans: nobody reaps them at once, they just exit
        while [pid for pid in pids if is_running_not_zombie(pid)] and monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if is_running_not_zombie(pid)]
    else:
        assert result.returncode == 0, result.stderr[-3000:]
        assert not [pid for pid in pids if is_running(pid)]
        for sign_of_trouble in ("Traceback", "leaked", "terminate called"):
            assert sign_of_trouble not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "shape,tp,dim", [("gqa", 3, "num_attention_heads"), ("mqa", 2, "num_key_value_heads")]
)
def test_a_size_that_does_not_divide_the_model_is_a_value_error_before_spawning(
    checkpoints, shape, tp, dim
):
    import multiprocessing

    with pytest.raises(ValueError, match=f"{dim}.*tensor_parallel_size 1"):
        LLM(str(checkpoints[shape]), tensor_parallel_size=tp)
    assert not multiprocessing.active_children()


# -- weight loaders: each rank takes its own shard (no processes needed) ------------


def shard_layers(rank: int) -> dict:
    with tp_group_scope(TPGroup(rank=rank, size=2)):
        return {
            "qkv": QKVParallelLinear(
                8, head_dim=2, total_num_heads=4, total_num_kv_heads=2, bias=True
            ),
            "gate_up": MergedColumnParallelLinear(8, [6, 6]),
            "down": RowParallelLinear(6, 8, bias=True),
            "embed": VocabParallelEmbedding(10, 8),
        }


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_its_own_shard(rank):
    layers = shard_layers(rank)
    full = {
        name: torch.randn(rows, 8)
        for name, rows in [("q", 8), ("k", 4), ("v", 4), ("gate", 6), ("up", 6), ("embed", 10)]
    }
    qkv = layers["qkv"]
    for shard_id in "qkv":
        qkv.weight.weight_loader(qkv.weight, full[shard_id], shard_id)
        qkv.bias.weight_loader(qkv.bias, full[shard_id][:, 0], shard_id)
    q, k, v = (full[n].chunk(2)[rank] for n in "qkv")
    assert torch.equal(qkv.weight, torch.cat([q, k, v]))
    assert torch.equal(qkv.bias, torch.cat([q, k, v])[:, 0])
    gate_up = layers["gate_up"]
    for i, name in enumerate(["gate", "up"]):
        gate_up.weight.weight_loader(gate_up.weight, full[name], i)
    assert torch.equal(
        gate_up.weight, torch.cat([full["gate"].chunk(2)[rank], full["up"].chunk(2)[rank]])
    )
    down, down_weight, down_bias = layers["down"], torch.randn(8, 6), torch.randn(8)
    down.weight.weight_loader(down.weight, down_weight)
    down.bias.weight_loader(down.bias, down_bias)
    assert torch.equal(down.weight, down_weight[:, 3 * rank : 3 * rank + 3])
    assert torch.equal(down.bias, down_bias)  # 1-D: whole on every rank, added by rank 0 only
    embed = layers["embed"]
    embed.weight.weight_loader(embed.weight, full["embed"])
    assert torch.equal(embed.weight, full["embed"][5 * rank : 5 * rank + 5])


def test_merged_column_parts_must_each_divide():
    with tp_group_scope(TPGroup(rank=0, size=2)):
        with pytest.raises(AssertionError, match=r"\[3, 3\]"):  # Config refuses it first
            MergedColumnParallelLinear(8, [3, 3])  # the sum, 6, would divide


def test_a_steps_inputs_reach_a_worker_intact_and_hold_no_sequence():
    """What rank 0 pickles per step: the host-built tensors of prepare_inputs, as arrays."""
    import io
    import pickle
    from dataclasses import fields

    from nanovllm.core.sequence import Sequence
    from nanovllm.distributed.workers import TensorsAsArrays
    from nanovllm.runner.step_inputs import prepare_inputs

    decoding = Sequence(list(range(20)), None, BLOCK)
    decoding.block_table.extend([3, 1])
    decoding.is_prefill, decoding.num_scheduled_tokens = False, 1
    prefilling = Sequence(list(range(40, 70)), None, BLOCK)
    prefilling.block_table.extend([5, 0])
    prefilling.num_cached_tokens = BLOCK  # a cached prefix
    prefilling.num_scheduled_tokens = 30 - BLOCK
    inputs = prepare_inputs([decoding, prefilling], BLOCK)
    message = io.BytesIO()
    TensorsAsArrays(message, pickle.HIGHEST_PROTOCOL).dump(("forward", (inputs, None)))
    assert b"Sequence" not in message.getvalue()
    method, (received, feed) = pickle.loads(message.getvalue())
    assert method == "forward" and feed is None

    def same(a, b):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        elif hasattr(a, "__dataclass_fields__"):
            for f in fields(a):
                same(getattr(a, f.name), getattr(b, f.name))
        else:
            assert a == b

    same(inputs.input_ids, received.input_ids)
    same(inputs.positions, received.positions)
    same(inputs.context, received.context)
    assert received.context.decode is not None and received.context.prefill is not None
