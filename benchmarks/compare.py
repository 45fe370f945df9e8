"""bench.py --compare: each engine in its own process group, its memory polled from
outside, its stderr (progress bar, warnings) passed on as it comes, and the results side by
side in one table."""

import codecs
import os
import signal
import subprocess
import sys
import threading
from typing import IO, NamedTuple

INTERRUPT_GRACE_S = 30  # for an engine told of Ctrl-C to write its figures so far
STDERR_TAIL_CHARS = 16384  # of an engine's stderr, kept for its result


class GroupRun(NamedTuple):
    status: str  # "ok", "failed (exit N)", "timed out (Ns)" or "interrupted"
    stderr: str  # its tail
    peak_rss_mib: float  # resident memory summed over the group's processes
    peak_gpu_mib: float | None  # CUDA memory in use above the level before the start


def run_in_process_group(cmd: list[str], timeout: float, cuda: bool) -> GroupRun:
    """Run `cmd` in a new session and kill its whole process group afterwards, whatever
    happened (vLLM leaves helper processes behind). Ctrl-C reaches only our own group: it is
    passed on as SIGINT, so the engine ends its run with the figures so far."""
    monitor = MemoryMonitor(cuda)
    proc = subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    monitor.start(proc.pid)
    stderr = StderrRelay(proc.stderr)
    try:
        proc.wait(timeout=timeout)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timed out ({timeout:.0f}s)"
    except KeyboardInterrupt:
        status = "interrupted"
        signal_group(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    finally:
        monitor.stop()
        kill_group(proc.pid)
        proc.wait()
        stderr.join()
    return GroupRun(status, stderr.tail, monitor.peak_rss_mib, monitor.peak_gpu_mib)


class StderrRelay:
    """Copies a child's stderr to ours as it comes (its progress bar redraws in place) and
    keeps the tail."""

    def __init__(self, pipe: IO[bytes]):
        self.tail = ""
        self._pipe = pipe
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a chunk may end
        while chunk := os.read(self._pipe.fileno(), 65536):  # inside a character
            text = decoder.decode(chunk)
            sys.stderr.write(text)
            sys.stderr.flush()
            self.tail = (self.tail + text)[-STDERR_TAIL_CHARS:]

    def join(self) -> None:
        self._thread.join()
        self._pipe.close()


def signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def kill_group(pgid: int) -> None:
    signal_group(pgid, signal.SIGKILL)


class MemoryMonitor:
    """Polls the peak memory of one process group: resident memory summed over its
    processes (from /proc, Linux) and, on CUDA, device memory in use above the level
    found before the group started."""

    def __init__(self, cuda: bool, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.peak_rss_mib = 0.0
        self.peak_gpu_mib = 0.0 if cuda else None
        self._gpu_base = _cuda_used_mib() if cuda else 0.0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, pgid: int) -> None:
        self._thread = threading.Thread(target=self._poll, args=(pgid,), daemon=True)
        self._thread.start()

    def _poll(self, pgid: int) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._done.wait(self.interval_s):
            pages = sum(rss for pgrp, rss in _proc_stats() if pgrp == pgid)
            self.peak_rss_mib = max(self.peak_rss_mib, pages * page / 2**20)
            if self.peak_gpu_mib is not None:
                self.peak_gpu_mib = max(self.peak_gpu_mib, _cuda_used_mib() - self._gpu_base)

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def _cuda_used_mib() -> float:
    import torch

    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def _proc_stats():
    """(process group, resident pages) of every process we can read."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # the process ended meanwhile
            yield int(fields[2]), int(fields[21])  # stat fields 5 (pgrp) and 24 (rss)


def print_table(results: list[dict]) -> None:
    ours = results[0]
    gpu = any(r.get("peak_gpu_mib") is not None for r in results)
    rows = [
        [
            "engine",
            "output tok/s",
            "total tok/s",
            "time (s)",
            "peak RSS (MiB)",
            *(["peak GPU (MiB)"] if gpu else []),
            "nanovllm / engine",
        ]
    ]
    for r in results:
        if r["status"] != "ok":
            rows.append([r["engine"], r["status"]] + [""] * (len(rows[0]) - 2))
            continue
        ratio = f"{ours['output_tok_s'] / r['output_tok_s']:.2f}x" if ours["status"] == "ok" else ""
        memory = [f"{r['peak_rss_mib']:.0f}"]
        if gpu:
            memory.append(f"{r['peak_gpu_mib']:.0f}" if r.get("peak_gpu_mib") is not None else "")
        rows.append(
            [
                r["engine"],
                f"{r['output_tok_s']:.1f}",
                f"{r['total_tok_s']:.1f}",
                f"{r['time_s']:.2f}",
                *memory,
                ratio,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
