"""The Triton kernels and backend selection.

tests/kernels/ holds the kernel tests proper (against the torch reference). Triton reads
TRITON_INTERPRET when a kernel is defined, so they run here in a subprocess with
TRITON_INTERPRET=1 (the CPU interpreter), leaving this process's environment alone; on
a CUDA machine pytest also runs that folder directly, on the GPU.
"""

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

if sys.platform == "linux":  # a hard dependency there: missing, it fails, not skips
    import triton  # noqa: F401

from nanovllm.attention.backend import select_backend
from nanovllm.attention.triton_backend import import_error
from nanovllm.kernels import interpreted
from nanovllm.platforms.cpu import CpuPlatform
from nanovllm.platforms.cuda import CudaPlatform

KERNEL_TESTS = Path(__file__).parent / "kernels"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device name: no GPU is touched


def flash_attn_installed() -> bool:
    return import_error("flash_attn") is None


@pytest.mark.slow
def test_kernels_match_torch_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(KERNEL_TESTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=KERNEL_TESTS.parent.parent,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 30, summary  # the tests ran, not skipped


@pytest.mark.skipif(interpreted(), reason="the interpreter is on")
def test_triton_on_cpu_without_the_interpreter_is_a_value_error():
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", CpuPlatform.attention_backends, CPU, 16)


@pytest.mark.skipif(interpreted(), reason="the interpreter is on")
def test_kernel_launcher_refuses_cpu_tensors_without_the_interpreter():
    from nanovllm.kernels import store_kvcache

    k = torch.zeros(1, 2, 8)
    with pytest.raises(AssertionError, match="k is on cpu.*TRITON_INTERPRET=1"):
        store_kvcache(k, k, torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1).long())


def test_auto_is_torch_on_cpu():
    assert select_backend("auto", CpuPlatform.attention_backends, CPU, 16).name == "torch"
    assert select_backend("torch", CpuPlatform.attention_backends, CPU, 16).name == "torch"


def test_flash_attn_on_cpu_is_a_value_error():
    with pytest.raises(ValueError, match="flash-attn needs a CUDA device"):
        select_backend("flash_attn", CpuPlatform.attention_backends, CPU, 256)


@pytest.mark.skipif(flash_attn_installed(), reason="flash-attn is installed")
def test_missing_flash_attn_is_a_value_error_and_auto_falls_back_to_triton():
    with pytest.raises(ValueError, match="flash-attn is not installed"):
        select_backend("flash_attn", CudaPlatform.attention_backends, CUDA, 256)
    assert select_backend("auto", CudaPlatform.attention_backends, CUDA, 256).name == "triton"


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """A stand-in `flash_attn` module, so the selection logic is testable without it."""
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = module.flash_attn_with_kvcache = lambda *a, **kw: None
    monkeypatch.setitem(sys.modules, "flash_attn", module)


def test_auto_prefers_flash_attn_when_block_size_allows(fake_flash_attn):
    assert select_backend("auto", CudaPlatform.attention_backends, CUDA, 256).name == "flash_attn"
    assert select_backend("auto", CudaPlatform.attention_backends, CUDA, 512).name == "flash_attn"
    assert select_backend("auto", CudaPlatform.attention_backends, CUDA, 16).name == "triton"


def test_flash_attn_with_a_block_size_not_multiple_of_256_is_a_value_error(fake_flash_attn):
    with pytest.raises(ValueError, match="kvcache_block_size % 256 == 0, got 16"):
        select_backend("flash_attn", CudaPlatform.attention_backends, CUDA, 16)


def test_decode_splits_depend_on_shapes_only(monkeypatch):
    from nanovllm.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "_num_sms", lambda device: 132)
    splits = paged_attention.decode_num_splits
    assert splits(1, 8, 4096, CUDA) == paged_attention.MAX_SPLITS  # few programs, long context
    assert splits(1, 8, 512, CUDA) == 2  # >= 256 keys per split
    assert splits(512, 8, 4096, CUDA) == 1  # the batch fills the GPU
    assert splits(4, 8, 4096, CUDA) == 8  # ceil(264 / 32) = 9, down to 2**3
    monkeypatch.setattr(paged_attention, "_num_sms", lambda device: 0)
    assert splits(1, 1, 4096, CPU) == 1  # interpreter: never split
