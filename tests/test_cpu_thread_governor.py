"""The contention governor (platforms/cpu/threads.py), by plain reasoning on samples: all
threads while they get the CPU, one while they wait for it, all again once the machine has idle
cores; its samples read from a /proc laid out in a temporary directory."""

import pytest
import torch

from nanovllm.platforms.cpu import threads as cpu_threads
from nanovllm.platforms.cpu.threads import SHARED, Sample, ThreadGovernor


def fake_proc(tmp_path, run_delays_ns: list[int], idle: int, busy: int):
    """A /proc whose threads have waited `run_delays_ns` and whose CPUs were `idle` and `busy`
    ticks (user time) since boot."""
    for tid, delay in enumerate(run_delays_ns, 100):
        task = tmp_path / "self" / "task" / str(tid)
        task.mkdir(parents=True, exist_ok=True)
        (task / "schedstat").write_text(f"123456 {delay} 7\n")
    (tmp_path / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    return tmp_path


@pytest.fixture
def governor(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads.os, "cpu_count", lambda: 2)
    yield ThreadGovernor(2, fake_proc(tmp_path, [0], idle=0, busy=0))
    torch.set_num_threads(threads)


def test_a_sample_sums_the_threads_waits_and_reads_the_machines_ticks(tmp_path):
    proc = fake_proc(tmp_path, [1_500_000_000, 250_000_000], idle=300, busy=700)
    sample = ThreadGovernor(2, proc).sample()
    assert sample.waited == pytest.approx(1.75)
    assert (sample.idle, sample.total) == (300, 1000)


def test_without_a_readable_proc_the_governor_does_nothing(tmp_path):
    governor = ThreadGovernor(2, tmp_path / "missing")
    assert governor.since is None
    for _ in range(100):
        governor.after_step()
    assert not governor.reduced


def test_threads_that_get_the_cpu_keep_all_threads(governor):
    torch.set_num_threads(2)
    governor.since = Sample(0.0, 0.0, 0, 0)
    governor.observe(Sample(1.0, SHARED * 0.9, 0, 200))  # waited less than SHARED of a second
    assert not governor.reduced and torch.get_num_threads() == 2


def test_threads_waiting_for_the_cpu_go_down_to_one_then_back_when_cores_idle(governor):
    torch.set_num_threads(2)
    governor.since = Sample(0.0, 0.0, 0, 0)
    governor.observe(Sample(1.0, SHARED * 1.1, 0, 200))
    assert governor.reduced and torch.get_num_threads() == 1
    governor.observe(Sample(2.0, SHARED * 1.1, 10, 400))  # the other core still busy: 5% idle
    assert governor.reduced and torch.get_num_threads() == 1
    governor.observe(Sample(3.0, SHARED * 1.1, 110, 600))  # half the machine idle: its core
    assert not governor.reduced and torch.get_num_threads() == 2


def test_the_governor_looks_every_window_of_steps(governor, monkeypatch):
    seen = []
    monkeypatch.setattr(governor, "observe", seen.append)
    monkeypatch.setattr(cpu_threads.time, "perf_counter", lambda: governor.since.wall)  # no time
    for _ in range(cpu_threads.WINDOW * 3):
        governor.after_step()
    assert len(seen) == 3 and all(isinstance(s, Sample) for s in seen)


def test_a_step_longer_than_the_window_is_looked_at_right_after(governor, monkeypatch):
    """A long prefill step: the look comes after it, not WINDOW steps later; while reduced, the
    probe's period in seconds holds as well."""
    clock = [governor.since.wall]
    seen = []

    def observe(sample):
        seen.append(sample)
        governor.since = sample._replace(wall=clock[0])

    monkeypatch.setattr(governor, "observe", observe)
    monkeypatch.setattr(cpu_threads.time, "perf_counter", lambda: clock[0])
    governor.after_step()
    assert seen == []  # a fast step
    clock[0] += 1.5 * cpu_threads.WINDOW_SECONDS
    governor.after_step()
    assert len(seen) == 1
    governor.reduced = True
    clock[0] += cpu_threads.WINDOW_SECONDS
    governor.after_step()
    assert len(seen) == 1  # the probe waits longer
    clock[0] += cpu_threads.PROBE_SECONDS
    governor.after_step()  # 0.5 s + a window since the last look
    assert len(seen) == 2
