"""Tensor parallelism over processes: rank 0 runs in the caller's process and drives
ranks 1..N-1, which it spawns here.

    caller's process                                  spawned process, rank r = 1..N-1
    LLMEngine, Scheduler, BlockManager, Sequences
    ModelRunner rank 0 --- ("forward", inputs) ---pipe---> worker_main: ModelRunner rank r
               <------ all-reduce / gather: gloo on CPU, NCCL on CUDA ------>

Workers answer only through the collectives; closing the pipes (end-of-file) is the exit signal.
"""

import copyreg
import io
import multiprocessing as mp
import os
import pickle
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from time import monotonic
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nanovllm.distributed.collectives import GROUP_TIMEOUT, join_tp_group
from nanovllm.distributed.group import TPGroup

if TYPE_CHECKING:
    from nanovllm.config import Config
    from nanovllm.distributed.launch import Torchrun

HOST = "127.0.0.1"  # every rank runs on this machine
JOIN_TIMEOUT_S = 5.0  # shutdown waits this long for a worker, then terminates it
JOINED = "worker/{}/joined"  # a spawned rank's key in rank 0's store once it is in


def init_tensor_parallel(
    config: "Config",
    device: torch.device,
    rank: int,
    port: int,
    launch: "Torchrun | None",
    runner_cls: type,
) -> tuple[TPGroup, "WorkerGroup | None"]:
    """This rank's TP group, and on rank 0 its handle on the spawned ranks 1..N-1 (each builds
    `runner_cls(config, rank, port)`). Under torchrun every rank joins its replica's group."""
    if not dist.is_available():
        raise ValueError(
            "tensor_parallel_size > 1 needs torch.distributed, which this PyTorch build lacks"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if launch is not None:
        from nanovllm.distributed.launch import engine_store, join_replica_tp_group

        return join_replica_tp_group(launch, engine_store(launch), device), None
    if rank > 0:
        return connect_worker(port, rank, config.tensor_parallel_size, device), None
    workers = WorkerGroup.spawn(config, device, runner_cls)
    return workers.tp_group, workers


def connect_worker(port: int, rank: int, world_size: int, device: torch.device) -> TPGroup:
    """A spawned rank joins the group rank 0 opened on `port` (blocks until every rank is in)."""
    store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=GROUP_TIMEOUT)
    store.set(JOINED.format(rank), "1")
    return join_tp_group(store, rank, world_size, device)


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1: spawns them, sends them calls, stops them."""

    def __init__(self) -> None:
        self.processes: list[mp.process.BaseProcess] = []
        self.pipes: list[Connection] = []  # rank 0's write ends, one per worker
        self.tp_group: TPGroup | None = None
        self.broken: str | None = None  # why the ranks may be out of step, once they are
        self._closing = threading.Event()
        self.watchdog: threading.Thread | None = None
        self._aborted = False

    @classmethod
    def spawn(cls, config: "Config", device: torch.device, runner_cls: type) -> "WorkerGroup":
        """Start ranks 1..N-1, each building `runner_cls(config, rank, port)`, and
        form the process group with them; rank 0's TPGroup is `.tp_group`."""
        world_size = config.tensor_parallel_size
        group = cls()
        try:
            store = dist.TCPStore(
                HOST, 0, world_size, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False
            )
            ctx = mp.get_context("spawn")
            for rank in range(1, world_size):
                reader, writer = ctx.Pipe(duplex=False)
                process = ctx.Process(
                    target=worker_main,
                    name=f"nanovllm-tp-rank{rank}",
                    args=(runner_cls, config, rank, store.port, reader),
                    daemon=True,
                )
                process.start()
                reader.close()  # left open here, writing to a dead worker's pipe would not fail
                group.processes.append(process)
                group.pipes.append(writer)
            group._wait_until_joined(store)
            group.tp_group = join_tp_group(store, 0, world_size, device)
        except BaseException:
            group.shutdown()
            raise
        group.watchdog = threading.Thread(
            target=group._abort_when_a_worker_dies,
            daemon=True,
            args=(group.tp_group.process_group,),
            name="nanovllm-tp-watchdog",
        )
        group.watchdog.start()
        return group

    def _wait_until_joined(self, store: dist.Store) -> None:
        """Until every worker reached the store; a worker that dies on the way (a failed
        import, a bad device) is reported at once instead of after the store's timeout."""
        keys = [JOINED.format(rank) for rank in range(1, len(self.processes) + 1)]
        deadline = monotonic() + GROUP_TIMEOUT.total_seconds()
        while not store.check(keys):
            self.check_alive()
            if monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {GROUP_TIMEOUT}")
            wait(self._sentinels(), timeout=0.05)  # a short sleep that a death cuts short

    def _sentinels(self) -> list[int]:
        return [p.sentinel for p in self.processes]

    def call(self, local: Callable, method: str, args: tuple) -> object:
        """Send `method(*args)` to every worker, run `local(*args)` here (their collectives
        pair up) and return its result. Raises RuntimeError if a worker is dead."""
        message = io.BytesIO()
        TensorsAsArrays(message, pickle.HIGHEST_PROTOCOL).dump((method, args))
        self._send(message.getvalue())
        try:
            result = local(*args)
        except BaseException as e:
            # The workers may be inside this call's collectives: the ranks are out of step.
            self.broken = f"a call to {method!r} failed on rank 0 ({type(e).__name__}: {e})"
            self.check_alive(grace_s=1.0, cause=e)  # a dead worker is the likely cause: say so
            raise
        self.check_alive()
        return result

    def _send(self, data: bytes) -> None:
        self.check_alive()
        if self.broken is not None:
            raise RuntimeError(
                f"the tensor-parallel ranks are out of step since {self.broken}; "
                "close this LLM and create a new one"
            )
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send_bytes(data)
            except OSError as e:  # BrokenPipeError: the worker is gone
                self.check_alive(grace_s=1.0, cause=e)
                raise RuntimeError(f"tensor-parallel worker rank {rank} is unreachable") from e

    def check_alive(self, grace_s: float = 0.0, cause: BaseException | None = None) -> None:
        """Raise RuntimeError naming a worker that has exited. `grace_s`: wait up to that
        long for one to exit (a dying worker's sockets close an instant before it does)."""
        ended = wait(self._sentinels(), timeout=grace_s)  # ready once a worker is exiting
        for rank, process in enumerate(self.processes, start=1):
            if process.sentinel in ended:
                process.join()  # exiting: wait the instant until its exit code is known
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code "
                    f"{process.exitcode} (its traceback, if any, is on stderr); this engine "
                    "cannot run any more: close it and create a new one"
                ) from cause

    def _abort_when_a_worker_dies(self, process_group: object) -> None:
        """Watchdog: on a worker's death, abort the group so that no rank-0 collective
        waits for it (with NCCL it would wait until GROUP_TIMEOUT)."""
        wait(self._sentinels())
        if not self._closing.is_set():
            self._aborted = True
            process_group.abort()

    def shutdown(self) -> None:
        """Stop the workers and release the process group; safe to call again."""
        self._closing.set()
        for pipe in self.pipes:
            pipe.close()  # end-of-file: each worker leaves its loop and exits
        self.pipes.clear()
        for process in self.processes:
            # Out of step, a worker may wait in a collective rank 0 never joins: no grace.
            stop_process(process, grace_s=JOIN_TIMEOUT_S if self.broken is None else 0.0)
        if self.watchdog is not None:  # ends with the workers; left running, it would keep
            self.watchdog.join()  # the group alive into exit(), which then aborts (1 in 4)
        if self.tp_group is not None and not self._aborted:
            self.tp_group.shutdown()
        self.tp_group = None


class TensorsAsArrays(pickle.Pickler):
    """A step's host-built tensors cross the pipe as numpy arrays, several times faster to pickle
    and unpickle than through torch's own tensor pickling (docs/parallelism.md)."""

    dispatch_table = copyreg.dispatch_table | {
        torch.Tensor: lambda t: (torch.from_numpy, (t.numpy(),))
    }


def stop_process(process: mp.process.BaseProcess, grace_s: float) -> None:
    process.join(grace_s)
    if process.exitcode is None:
        process.terminate()
        process.join(JOIN_TIMEOUT_S)
    if process.exitcode is None:
        process.kill()
        process.join()


def worker_main(runner_cls: type, config: "Config", rank: int, port: int, pipe: Connection) -> None:
    """A spawned rank: build its shard of the model, then run each call rank 0 sends
    until rank 0 closes the pipe. An exception ends the process (rank 0 notices)."""
    # Ctrl-C reaches the whole process group: rank 0 alone handles it (and stops us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_with_parent, daemon=True).start()
    runner = runner_cls(config, rank, port)
    try:
        while True:
            try:
                method, args = pickle.loads(pipe.recv_bytes())
            except EOFError:
                return
            getattr(runner, method)(*args)
    finally:
        runner.close()


def exit_with_parent() -> None:
    """Rank 0's process is gone (killed, crashed): leave even from inside a collective."""
    mp.parent_process().join()
    os._exit(1)
