"""Data parallelism, offline: `data_parallel_size` engine replicas, each over its own
`tensor_parallel_size` ranks; generate() splits the prompts (split_by_tokens) across them."""

import multiprocessing as mp
import os
import signal
import threading
from dataclasses import fields
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.distributed.group import join_tp_group
from nanovllm.distributed.launch import Torchrun, engine_store
from nanovllm.distributed.workers import JOIN_TIMEOUT_S, exit_with_parent, stop_process


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


class TorchrunReplicas:
    """Replicas made of torchrun's ranks: each rank runs its replica's share, and the
    outputs meet over a gloo group of every rank."""

    def __init__(self, launch: Torchrun) -> None:
        self.launch = launch
        self.rank = launch.dp_rank
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
        return self.world.all_gather_objects(local, torch.device("cpu"))[:: self.launch.tp_size]

    def close(self) -> None:
        self.world.shutdown()


class SpawnedReplicas:
    """Replicas 1..D-1, each a whole LLM in a process of its own (spawning its own
    tensor-parallel ranks), fed their shares through a pipe."""

    rank = 0

    def __init__(self, config: Config) -> None:
        kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
        kwargs["data_parallel_size"] = 1
        ctx = mp.get_context("spawn")
        self.pipes: list[Connection] = []
        self.processes: list[mp.process.BaseProcess] = []
        threads = max(1, torch.get_num_threads() // config.data_parallel_size)
        gpus = torch.cuda.device_count() if config.device != "cpu" else 0
        for replica in range(1, config.data_parallel_size):
            first = replica * config.tensor_parallel_size  # its GPUs, when there are GPUs
            devices = ",".join(map(str, range(first, first + config.tensor_parallel_size)))
            ours, theirs = ctx.Pipe()
            process = ctx.Process(
                target=replica_main,
                name=f"nanovllm-dp-replica{replica}",
                args=(kwargs, devices if gpus else None, threads, theirs),
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


def start_replicas(
    config: Config, launch: Torchrun | None
) -> TorchrunReplicas | SpawnedReplicas | None:
    if config.data_parallel_size == 1:
        return None
    return SpawnedReplicas(config) if launch is None else TorchrunReplicas(launch)


def replica_main(
    kwargs: dict, visible_devices: str | None, num_threads: int, pipe: Connection
) -> None:
    """A spawned replica: generate() each share it is sent until the pipe closes."""
    if visible_devices is not None:  # before CUDA starts: its GPUs are cuda:0, cuda:1, ...
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    torch.set_num_threads(num_threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller handles Ctrl-C and stops us
    threading.Thread(target=exit_with_parent, daemon=True).start()
    from nanovllm import LLM  # entrypoints/llm.py imports this module

    with LLM(**kwargs) as llm:
        while True:
            try:
                prompts, params = pipe.recv()
            except EOFError:
                return
            try:
                pipe.send(("ok", llm.generate(prompts, params, use_tqdm=False)))
            except Exception as e:  # a bad share fails its call, not the replica
                pipe.send(("error", e))
