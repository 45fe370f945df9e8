"""KV-cache sizing arithmetic (runner/kv_cache.py, platforms/cuda/memory.py), by plain
reasoning: pure functions of a memory profile, so the CUDA budget is checked on the CPU with
made-up devices."""

import pytest

from nanovllm import LLM
from nanovllm.platforms.cuda.memory import SAFETY_MARGIN, MemoryProfile, kv_cache_budget
from nanovllm.runner.kv_cache import num_blocks_within

GIB = 2**30


def profile(*, total=80, free=70, peak=6, current=4, graph_pool=0) -> MemoryProfile:
    """A device in GiB; the arithmetic is the same in bytes."""
    return MemoryProfile(total * GIB, free * GIB, peak * GIB, current * GIB, graph_pool * GIB)


def test_alone_on_the_device_the_cache_takes_the_cap_less_our_peak():
    # 0.9 * 80 = 72 GiB ours; 6 at peak; 66 left, and 70 - (6 - 4) = 68 is free
    assert kv_cache_budget(profile(), 0.9) == int(0.9 * 80 * GIB) - 6 * GIB - SAFETY_MARGIN


def test_the_graph_pool_still_to_come_is_left_out():
    assert (
        kv_cache_budget(profile(graph_pool=1), 0.9) == int(0.9 * 80 * GIB) - 7 * GIB - SAFETY_MARGIN
    )


def test_other_processes_do_not_shrink_our_cap_while_enough_is_free():
    # another process holds 20 GiB: 50 GiB free; our cap (0.5 * 80 = 40) - 6 = 34 fits
    assert kv_cache_budget(profile(free=50), 0.5) == 34 * GIB - SAFETY_MARGIN


def test_never_more_than_is_free_less_the_activations_we_need_again():
    # another process holds 60 GiB: 14 free, 2 of which our activations will take back
    assert kv_cache_budget(profile(free=14), 0.9) == 12 * GIB - SAFETY_MARGIN


def test_nothing_left_is_zero_never_negative():
    assert kv_cache_budget(profile(free=1), 0.9) == 0  # others took everything
    assert kv_cache_budget(profile(peak=10), 0.1) == 0  # our cap is below our peak


def test_blocks_are_whole_and_fewer_than_one_is_a_value_error_naming_what_to_change():
    assert num_blocks_within(10 * 1024 + 5, 1024, "hint") == 10
    with pytest.raises(
        ValueError,
        match=r"even one KV-cache block \(1024 bytes; 1000 bytes "
        r"left\); raise gpu_memory_utilization",
    ):
        num_blocks_within(1000, 1024, "raise gpu_memory_utilization")


def test_a_cpu_budget_below_one_block_says_to_raise_it(checkpoints):
    with pytest.raises(ValueError, match="raise cpu_kvcache_space_gib"):
        LLM(str(checkpoints["gqa"]), device="cpu", cpu_kvcache_space_gib=1e-9)
