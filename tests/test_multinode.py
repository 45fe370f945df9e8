"""Beyond one process group per host: ranks launched by torchrun (two "nodes" on 127.0.0.1,
gloo) and data-parallel replicas. Every rank and every replica layout gives the tokens one
process gives, in prompt order; the greedy ones are also transformers' tokens."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_qwen3_parity import expected, make_prompts

from nanovllm import LLM, SamplingParams
from nanovllm.distributed.data_parallel import split_by_tokens

SCRIPT = Path(__file__).with_name("torchrun_generate.py")
HOST = "127.0.0.1"
ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64)


def sampling(num_prompts: int) -> list[SamplingParams]:
    """Seeded sampling and greedy, alternating: what torchrun_generate.py asks for."""
    return [
        SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=8 + i, ignore_eos=True)
        for i in range(num_prompts)
    ]


@pytest.fixture(scope="module")
def model(checkpoints) -> str:
    return str(checkpoints["gqa"])


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts([5, 17, 3, 40, 9, 24], seed=11)


@pytest.fixture(scope="module")
def one_process(model, prompts) -> list[list[int]]:
    """The reference: one process, one rank; its greedy rows are transformers'."""
    with LLM(model, **ENGINE) as llm:
        tokens = [
            o.outputs[0].token_ids
            for o in llm.generate(prompts, sampling(len(prompts)), use_tqdm=False)
        ]
    for i in range(1, len(prompts), 2):
        assert tokens[i] == expected(model, [prompts[i]], 8 + i)[0]
    return tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def torchrun(
    tmp_path: Path,
    model: str,
    prompts,
    nnodes: int,
    nproc: int,
    tp: int,
    dp: int,
    *extra: str,
    ranks: tuple[int, ...] | None = None,
    timeout_s: float = 150,
) -> dict[int, object]:
    """Launch `nnodes` torchrun agents on this host, wait (bounded) for the files of `ranks`
    (all by default), and leave no process behind; returns each rank's result."""
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    port, world = free_port(), nnodes * nproc
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nnodes}",
                f"--nproc-per-node={nproc}",
                f"--node-rank={node}",
                f"--master-addr={HOST}",
                f"--master-port={port}",
                str(SCRIPT),
                model,
                str(tmp_path),
                str(tp),
                str(dp),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"node{node}.log", "w"),
            start_new_session=True,
        )
        for node in range(nnodes)
    ]
    files = [tmp_path / f"rank{r}.json" for r in (range(world) if ranks is None else ranks)]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not all(f.exists() for f in files):
            if all(a.poll() is not None for a in agents):
                break
            time.sleep(0.2)
        if ranks is None:  # a success: every agent exits by itself
            for agent in agents:
                agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    return {
        r: json.loads(f.read_text())
        for r in range(world)
        if (f := tmp_path / f"rank{r}.json").exists()
    }


def test_prompts_are_split_longest_first_to_the_least_loaded_replica():
    # costs 5, 1, 1, 1, 4 -> 5: r0 | 4: r1 | 1: r1 (4 < 5) | 1: r0 (5 = 5, the lower) | 1: r1
    assert split_by_tokens([5, 1, 1, 1, 4], 2) == [[0, 2], [1, 3, 4]]
    assert split_by_tokens([3, 3], 3) == [[0], [1], []]
    shares = split_by_tokens(list(range(1, 21)), 3)
    assert sorted(i for share in shares for i in share) == list(range(20))
    loads = [sum(i + 1 for i in share) for share in shares]
    # each prompt went to the least loaded replica: no replica ends more than one prompt
    # (at most the first, costliest, 20) above another; here it is within 2 of 70 each
    assert max(loads) - min(loads) <= 2 and sum(loads) == 210


@pytest.mark.slow
def test_torchrun_two_nodes_tp2_equals_one_process(tmp_path, model, prompts, one_process):
    results = torchrun(tmp_path, model, prompts, nnodes=2, nproc=1, tp=2, dp=1)
    assert results == {0: one_process, 1: one_process}


@pytest.mark.slow
def test_torchrun_dp2_x_tp2_equals_one_process(tmp_path, model, prompts, one_process):
    results = torchrun(tmp_path, model, prompts, nnodes=1, nproc=4, tp=2, dp=2)
    assert results == dict.fromkeys(range(4), one_process)


@pytest.mark.slow
def test_torchrun_rank_that_dies_is_a_runtime_error_within_seconds(tmp_path, model, prompts):
    results = torchrun(
        tmp_path, model, prompts, 2, 1, 2, 1, "--die-rank", "1", ranks=(0,), timeout_s=90
    )
    assert results[0]["error"] == "RuntimeError"
    assert results[0]["seconds"] < 10
    assert 1 not in results


def test_world_that_is_not_tp_times_dp_is_refused_before_weights_load(tmp_path, model, monkeypatch):
    weightless = shutil.copytree(
        model, tmp_path / "weightless", ignore=shutil.ignore_patterns("*.safetensors*")
    )
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", HOST)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(
        ValueError,
        match=r"3 ranks but tensor_parallel_size=2 x "
        r"data_parallel_size=1 = 2",
    ):
        LLM(str(weightless), tensor_parallel_size=2, **ENGINE)


@pytest.mark.slow
def test_spawned_replicas_equal_one_process_in_prompt_order(model, prompts, one_process):
    with LLM(model, data_parallel_size=2, **ENGINE) as llm:
        outputs = llm.generate(prompts, sampling(len(prompts)), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == one_process
        assert [o.prompt_token_ids for o in outputs] == prompts
        with pytest.raises(ValueError, match="prompt 1: .*outside the model's vocabulary"):
            llm.generate([prompts[0], [10**6]], use_tqdm=False)
        again = llm.generate(prompts[:3], sampling(3), use_tqdm=False)  # still usable
        assert [o.outputs[0].token_ids for o in again] == one_process[:3]


def test_spawned_replica_that_dies_is_a_runtime_error(model, prompts):
    with LLM(model, data_parallel_size=2, **ENGINE) as llm:
        replica = llm.replicas.processes[0]
        os.kill(replica.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="replica 1 .* exited"):
            llm.generate(prompts, sampling(len(prompts)), use_tqdm=False)
        assert time.monotonic() - start < 10
