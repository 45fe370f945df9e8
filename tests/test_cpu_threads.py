"""The CPU thread count (platforms/cpu/threads.py), by plain reasoning: a pure function of the
affinity mask, the cgroup quota, the environment and the config; the quota read from cgroup v1
and v2 files laid out in a temporary directory; an engine started under a simulated quota."""

import logging

import pytest
import torch

from nanovllm import LLM
from nanovllm.platforms.cpu import threads as cpu_threads
from nanovllm.platforms.cpu.threads import cgroup_cpu_quota, choose_num_threads, physical_cores


def test_omp_num_threads_wins_then_the_config():
    assert choose_num_threads(3, {"OMP_NUM_THREADS": "5"}, 8, 1.0)[::2] == (5, False)
    assert choose_num_threads(3, {}, 8, 1.0)[::2] == (3, False)  # given, not chosen
    assert choose_num_threads(0, {"OMP_NUM_THREADS": ""}, 8, None).num_threads == 8


def test_a_quota_below_the_affinity_mask_rounds_down_to_at_least_one():
    assert choose_num_threads(0, {}, 64, 1.5) == (1, "the cgroup's CPU quota is 1.5 CPUs", True)
    assert choose_num_threads(0, {}, 64, 2.0).num_threads == 2
    assert choose_num_threads(0, {}, 64, 0.25).num_threads == 1
    assert choose_num_threads(0, {}, 2, 8.0).num_threads == 2  # the mask is tighter
    assert choose_num_threads(0, {}, 2, None) == (
        2,
        "2 cores in this process's affinity mask",
        True,
    )


def test_tensor_parallel_ranks_on_one_machine_share_the_cpus():
    assert choose_num_threads(0, {}, 8, None, ranks=2).num_threads == 4
    assert choose_num_threads(0, {}, 8, 3.0, ranks=2).num_threads == 1
    assert choose_num_threads(0, {}, 1, None, ranks=4).num_threads == 1


def test_hyperthread_siblings_count_as_one_core(tmp_path):
    for cpu, core in enumerate([0, 1, 0, 1]):  # cpus 2 and 3: the siblings of 0 and 1
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert physical_cores({0, 1, 2, 3}, tmp_path) == 2
    assert physical_cores({0, 2}, tmp_path) == 1
    assert physical_cores({0, 1, 7}, tmp_path) == 3  # no topology for cpu 7: count CPUs


def write_cgroup(tmp_path, lines: list[str], files: dict[str, str]):
    """A /proc/self/cgroup with `lines` and a cgroup mount at tmp_path/fs with `files`."""
    (tmp_path / "self").write_text("\n".join(lines) + "\n")
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "fs", tmp_path / "self"


def test_cgroup_v2_quota_is_the_tightest_on_the_path(tmp_path):
    root, self_cgroup = write_cgroup(
        tmp_path,
        ["0::/pod/app"],
        {"pod/cpu.max": "100000 100000", "pod/app/cpu.max": "250000 100000"},
    )
    assert cgroup_cpu_quota(root, self_cgroup) == 1.0


def test_cgroup_v2_without_a_limit_is_none(tmp_path):
    root, self_cgroup = write_cgroup(tmp_path, ["0::/"], {"cpu.max": "max 100000"})
    assert cgroup_cpu_quota(root, self_cgroup) is None


def test_cgroup_v1_quota_and_its_unlimited_minus_one(tmp_path):
    files = {
        "cpu,cpuacct/job/cpu.cfs_quota_us": "50000",
        "cpu,cpuacct/job/cpu.cfs_period_us": "100000",
    }
    root, self_cgroup = write_cgroup(tmp_path, ["4:cpu,cpuacct:/job", "3:memory:/job"], files)
    (root / "cpu").symlink_to("cpu,cpuacct")  # as systemd mounts v1's cpu controller
    assert cgroup_cpu_quota(root, self_cgroup) == 0.5
    (root / "cpu/job/cpu.cfs_quota_us").write_text("-1")
    assert cgroup_cpu_quota(root, self_cgroup) is None


def test_no_cgroup_file_is_no_limit(tmp_path):
    assert cgroup_cpu_quota(tmp_path, tmp_path / "missing") is None


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_an_engine_under_a_one_cpu_quota_computes_with_one_thread(
    checkpoints, tmp_path, monkeypatch, caplog, restore_threads
):
    root, self_cgroup = write_cgroup(tmp_path, ["0::/"], {"cpu.max": "100000 100000"})
    monkeypatch.setattr(
        cpu_threads, "cgroup_cpu_quota", lambda: cgroup_cpu_quota(root, self_cgroup)
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "_logged", set())
    torch.set_num_threads(2)
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        with LLM(str(checkpoints["gqa"]), device="cpu", num_kvcache_blocks=8) as llm:
            assert torch.get_num_threads() == 1
            assert len(llm.generate([[1, 2, 3]], use_tqdm=False)[0]["token_ids"]) > 0
    assert "CPU threads: 1 (the cgroup's CPU quota is 1 CPUs)" in caplog.text
