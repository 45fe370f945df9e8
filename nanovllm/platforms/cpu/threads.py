"""How many threads a CPU run computes with: what the process may really use, not every core the
machine shows (a container limited to 1.5 CPUs on a 64-core host sees 64 cores, and 64 threads
whose barriers wait on descheduled ones):

    OMP_NUM_THREADS set      it wins (torch took it when it started)
    Config.cpu_threads > 0   as asked
    else                     the physical cores of the affinity mask, at most the cgroup's CPU
                             quota (rounded down), shared by the engine's ranks here; at least 1

and fewer while the CPU is shared with other work (docs/cpu.md has why and the figures). A chosen
count (not a given one) is governed, looking every few steps:

    all threads   the time they waited runnable for a CPU (Linux's schedstat) per second of
                  wall time; above SHARED -> one thread, which no barrier can hold up
    one thread    the machine's idle time (/proc/stat); at least FREE of the cores given up
                  were idle -> all threads again
"""

import contextlib
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch


class ThreadChoice(NamedTuple):
    num_threads: int
    reason: str
    chosen: bool = True  # by the rule, not given (OMP_NUM_THREADS, cpu_threads)


def choose_num_threads(
    configured: int, environ: Mapping[str, str], cores: int, quota: float | None, ranks: int = 1
) -> ThreadChoice:
    """The rule above: `cores` the process may run on, `quota` CPUs per period its cgroup
    allows (None: no limit), `ranks` the engine's processes sharing them."""
    if environ.get("OMP_NUM_THREADS", "").strip().isdigit():
        return ThreadChoice(int(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS is set", False)
    if configured > 0:
        return ThreadChoice(configured, "cpu_threads as configured", False)
    cpus, why = cores, f"{cores} cores in this process's affinity mask"
    if quota is not None and quota < cores:
        cpus, why = math.floor(quota), f"the cgroup's CPU quota is {quota:g} CPUs"
    if ranks > 1:
        cpus, why = cpus // ranks, f"{why}, shared by {ranks} ranks"
    return ThreadChoice(max(1, cpus), why)


def physical_cores(cpus: set[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """Distinct (package, core) pairs among `cpus`: hyperthread siblings count once, as in
    torch's default. len(cpus) where the topology is unknown."""
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            package, core = (topology / "physical_package_id").read_text(), (topology / "core_id")
            cores.add((package, core.read_text()))
        except OSError:
            return len(cpus)
    return len(cores)


def cgroup_cpu_quota(
    root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """CPUs per period this process's cgroup may use: the tightest quota on its path to the root,
    cgroup v2 (cpu.max) or v1 (cpu.cfs_quota_us / cpu.cfs_period_us); None without one."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        is_v2 = controllers == ""
        if is_v2 or "cpu" in controllers.split(","):
            mount = root if is_v2 else root / "cpu"
            for directory in [mount / path.strip("/"), *(mount / path.strip("/")).parents]:
                quotas.append(_read_quota(directory, is_v2))
                if directory == mount:
                    break
    return min((q for q in quotas if q is not None), default=None)


def _read_quota(directory: Path, is_v2: bool) -> float | None:
    try:
        if is_v2:
            quota, period = (directory / "cpu.max").read_text().split()
        else:
            quota, period = (
                (directory / f"cpu.cfs_{f}_us").read_text() for f in ("quota", "period")
            )
    except (OSError, ValueError):
        return None
    return None if quota.strip() in ("max", "-1") else int(quota) / int(period)


def set_num_threads(configured: int, ranks: int = 1) -> ThreadChoice:
    """Choose and set torch's intra-op threads for this process; a new choice is logged once."""
    cores = physical_cores(os.sched_getaffinity(0))
    choice = choose_num_threads(configured, os.environ, cores, cgroup_cpu_quota(), ranks)
    if choice.num_threads != torch.get_num_threads():
        torch.set_num_threads(choice.num_threads)
    if choice not in _logged:
        _logged.add(choice)
        logging.getLogger("nanovllm").info("CPU threads: %d (%s)", *choice[:2])
    return choice


_logged: set[ThreadChoice] = set()

# -- fewer threads while the CPU is shared ----------------------------------------------------

# A look comes after so many steps or so many seconds since the last, whichever is first: a
# step may take a millisecond (a small model's decode) or seconds (a long prefill, where a short
# run spends most of its time; counting steps alone, the first look came after it).
WINDOW = 8  # steps between two looks at the threads' waits, on all threads
WINDOW_SECONDS = 0.1
SHARED = 0.25  # seconds waited for a CPU per second of wall time that mean a shared machine
PROBE = 32  # steps between two looks at the machine's idle time, on one thread
PROBE_SECONDS = 0.5
FREE = 0.8  # the share of the given-up cores that must be idle to take them back


class Sample(NamedTuple):
    wall: float  # perf_counter seconds
    waited: float  # seconds this process's threads were runnable but waiting for a CPU
    idle: int  # the machine's idle ticks since boot, all CPUs
    total: int  # all its ticks since boot


class ThreadGovernor:
    """after_step() after each step of a runner that chose `threads` (the top)."""

    def __init__(self, threads: int, proc: Path = Path("/proc")):
        self.threads, self.proc = threads, proc
        self.reduced = False
        self.steps = 0
        self.since = self.sample()  # None where /proc cannot be read: nothing is governed

    def after_step(self) -> None:
        if self.since is None:
            return
        self.steps += 1
        steps, seconds = (PROBE, PROBE_SECONDS) if self.reduced else (WINDOW, WINDOW_SECONDS)
        if self.steps >= steps or time.perf_counter() - self.since.wall >= seconds:
            self.steps = 0  # steps since the last look
            self.observe(self.sample())

    def sample(self) -> Sample | None:
        try:
            waited = 0
            for task in (self.proc / "self/task").iterdir():
                with contextlib.suppress(OSError):  # a thread that just ended
                    waited += int((task / "schedstat").read_text().split()[1])  # run_delay, ns
            ticks = [int(x) for x in (self.proc / "stat").read_text().split()[1:9]]
        except (OSError, ValueError, IndexError):
            return None
        return Sample(time.perf_counter(), waited / 1e9, ticks[3] + ticks[4], sum(ticks))

    def observe(self, now: Sample | None) -> None:
        """Switch threads if the steps since the last sample say so."""
        if now is None:
            return
        last, self.since = self.since, now
        if not self.reduced and now.waited - last.waited > SHARED * (now.wall - last.wall):
            self.set_threads(1, "the CPU is shared")
        elif self.reduced:
            idle = (now.idle - last.idle) / max(now.total - last.total, 1)
            if idle >= FREE * (self.threads - 1) / (os.cpu_count() or self.threads):
                self.set_threads(self.threads, "the CPU is free again")

    def set_threads(self, threads: int, reason: str) -> None:
        torch.set_num_threads(threads)
        self.reduced = threads < self.threads
        logging.getLogger("nanovllm").debug("CPU threads: %d (%s)", threads, reason)
