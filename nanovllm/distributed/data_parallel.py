"""Data parallelism, offline: `data_parallel_size` engine replicas, each over its own
`tensor_parallel_size` ranks; LLM.generate() hands its prompts to Replicas.generate, which
splits them (split_by_tokens), runs each share on its replica and gathers the outputs in
prompt order. Replicas are spawned processes, or torchrun's ranks when it started us."""

import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import fields
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nanovllm.distributed import launched_by_torchrun
from nanovllm.distributed.collectives import join_tp_group
from nanovllm.distributed.launch import (
    Torchrun,
    all_gather_objects,
    engine_store,
    torchrun_launch,
)
from nanovllm.distributed.workers import JOIN_TIMEOUT_S, exit_with_parent, stop_process

if TYPE_CHECKING:
    from nanovllm.config import Config
    from nanovllm.engine.llm_engine import EngineRequest


def split_by_tokens(costs: list[int], num_replicas: int) -> list[list[int]]:
    """Prompt indices per replica: the costliest first, each to the replica with the fewest
    tokens so far (the lowest on a tie); each share in prompt order."""
    shares: list[list[int]] = [[] for _ in range(num_replicas)]
    loads = [0] * num_replicas
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        replica = min(range(num_replicas), key=lambda r: loads[r])
        shares[replica].append(i)
        loads[replica] += costs[i]
    return [sorted(share) for share in shares]


def request_cost(request: "EngineRequest", max_model_len: int) -> int:
    """The most tokens a request may hold in the KV cache, over its n sequences."""
    params = request.sampling_params
    final_len = len(request.prompt_token_ids) + (params.max_tokens or max_model_len)
    return params.n * min(max_model_len, final_len)


class Replicas:
    """What both kinds share: generate() over every replica, given dispatch() and gather()."""

    rank: int  # this process's replica

    def generate(
        self, prompts: list, params: list, requests: list, generate_here: Callable[[list], list]
    ) -> list:
        """Each replica runs its share (this one through `generate_here`, on its part of the
        checked `requests`); the outputs of all, in prompt order."""
        costs = [request_cost(r, self.max_model_len) for r in requests]
        shares = split_by_tokens(costs, self.num_replicas)
        self.dispatch(shares, prompts, params)
        mine = shares[self.rank]
        try:
            local = generate_here([requests[i] for i in mine])
        except BaseException:
            self.gather([])  # take the others' outputs: none is left for the next call
            raise
        outputs = [None] * len(prompts)
        for share, replica_outputs in zip(shares, self.gather(local)):
            for i, output in zip(share, replica_outputs):
                outputs[i] = output
        return outputs


class TorchrunReplicas(Replicas):
    """Replicas made of torchrun's ranks: each rank runs its replica's share, and the
    outputs meet over a gloo group of every rank."""

    def __init__(self, config: "Config", launch: Torchrun) -> None:
        self.launch = launch
        self.rank = launch.dp_rank
        self.num_replicas, self.max_model_len = config.data_parallel_size, config.max_model_len
        self.world = join_tp_group(
            dist.PrefixStore("world", engine_store(launch)),
            launch.rank,
            launch.world_size,
            torch.device("cpu"),
        )  # gloo

    def dispatch(self, shares: list[list[int]], prompts: list, params: list) -> None:
        pass  # every rank has every prompt already

    def gather(self, local: list) -> list[list]:
        """Each replica's outputs (those of its first rank)."""
        gathered = all_gather_objects(self.world, local, torch.device("cpu"))
        return gathered[:: self.launch.tp_size]

    def close(self) -> None:
        self.world.shutdown()


class SpawnedReplicas(Replicas):
    """Replicas 1..D-1, each a whole LLM in a process of its own (spawning its own
    tensor-parallel ranks), fed their shares through a pipe."""

    rank = 0

    def __init__(self, config: "Config", llm_class: type) -> None:
        self.num_replicas, self.max_model_len = config.data_parallel_size, config.max_model_len
        kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
        kwargs["data_parallel_size"] = 1
        ctx = mp.get_context("spawn")
        self.pipes: list[Connection] = []
        self.processes: list[mp.process.BaseProcess] = []
        threads = max(1, torch.get_num_threads() // config.data_parallel_size)
        gpus = torch.cuda.device_count() if config.device != "cpu" else 0
        if not gpus:  # the replicas share the CPUs: this one's share too
            kwargs["cpu_threads"] = config.cpu_threads or threads
            torch.set_num_threads(kwargs["cpu_threads"])
        for replica in range(1, config.data_parallel_size):
            first = replica * config.tensor_parallel_size  # its GPUs, when there are GPUs
            devices = ",".join(map(str, range(first, first + config.tensor_parallel_size)))
            ours, theirs = ctx.Pipe()
            process = ctx.Process(
                target=replica_main,
                name=f"nanovllm-dp-replica{replica}",
                args=(llm_class, kwargs, devices if gpus else None, threads, theirs),
            )
            process.start()
            theirs.close()
            self.pipes.append(ours)
            self.processes.append(process)

    def dispatch(self, shares: list[list[int]], prompts: list, params: list) -> None:
        for replica, share in enumerate(shares[1:], start=1):
            try:
                self.pipes[replica - 1].send(
                    ([prompts[i] for i in share], [params[i] for i in share])
                )
            except OSError as e:  # BrokenPipeError: it is gone
                raise self._died(replica) from e

    def gather(self, local: list) -> list[list]:
        return [local] + [self._receive(r) for r in range(1, len(self.pipes) + 1)]

    def _receive(self, replica: int) -> list:
        try:  # a replica that died closed its end: end-of-file or a reset, at once
            status, value = self.pipes[replica - 1].recv()
        except (EOFError, OSError) as e:
            raise self._died(replica) from e
        if status == "error":
            raise value
        return value

    def _died(self, replica: int) -> RuntimeError:
        process = self.processes[replica - 1]
        process.join()
        return RuntimeError(
            f"data-parallel replica {replica} (pid {process.pid}) exited with "
            f"code {process.exitcode}; close this LLM and create a new one"
        )

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.close()  # end-of-file: the replica closes its LLM and exits
        for process in self.processes:
            stop_process(process, JOIN_TIMEOUT_S)
        self.pipes.clear()
        self.processes.clear()


def start_replicas(config: "Config", llm_class: type) -> Replicas:
    """torchrun's ranks when it started us, else replicas 1..D-1 spawned, each an `llm_class`."""
    if launched_by_torchrun():
        launch = torchrun_launch(config.tensor_parallel_size, config.data_parallel_size)
        return TorchrunReplicas(config, launch)
    return SpawnedReplicas(config, llm_class)


def replica_main(
    llm_class: type, kwargs: dict, visible_devices: str | None, num_threads: int, pipe: Connection
) -> None:
    """A spawned replica: generate() each share it is sent until the pipe closes."""
    if visible_devices is not None:  # before CUDA starts: its GPUs are cuda:0, cuda:1, ...
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    torch.set_num_threads(num_threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller handles Ctrl-C and stops us
    threading.Thread(target=exit_with_parent, daemon=True).start()
    with llm_class(**kwargs) as llm:
        while True:
            try:
                prompts, params = pipe.recv()
            except EOFError:
                return
            try:
                pipe.send(("ok", llm.generate(prompts, params, use_tqdm=False)))
            except Exception as e:  # a bad share fails its call, not the replica
                pipe.send(("error", e))
