"""kernels/cpu_build.py tells a user that a first run compiles (it would look stalled), once a
process, and loads a cached library without a word."""

import logging

import pytest
from conftest import HAS_COMPILER

from nanovllm.kernels import cpu_bitmask, cpu_build, cpu_sample

pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler to build the kernels")


def build(module) -> bool:
    return cpu_build.load_library(module.SOURCE, module.FLAGS, "a fallback") is not None


def test_the_first_build_is_announced_once_and_a_cached_load_is_silent(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty cache: everything builds
    cpu_build._announce_first_build.cache_clear()
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        assert build(cpu_bitmask) and build(cpu_sample)  # the two quickest to compile
    cache = tmp_path / "nanovllm" / "kernels"
    assert [r.getMessage() for r in caplog.records] == [
        f"compiling the CPU kernels (once, cached under {cache}): ~{cpu_build.FIRST_BUILD_S} s"
    ]
    caplog.clear()
    cpu_build._announce_first_build.cache_clear()  # as a new process would start
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        assert build(cpu_bitmask)
    assert caplog.records == []
