"""dtype="auto" on a CPU: the checkpoint's half precision only where the CPU computes it
natively, else float32 when it fits; an explicit dtype is always obeyed."""

import json
import logging
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM
from nanovllm.demo import build_tiny_qwen3
from nanovllm.platforms.cpu.host import choose_cpu_dtype, cpu_flags, physical_memory

GIB = 2**30
AVX2 = frozenset({"avx", "avx2", "fma"})


def test_bf16_stays_where_the_cpu_computes_it():
    for flag in ("avx512_bf16", "amx_bf16"):
        assert choose_cpu_dtype("bfloat16", AVX2 | {flag}, GIB, 16 * GIB).dtype == "bfloat16"


def test_fp16_needs_its_own_flags_not_bf16s():
    assert choose_cpu_dtype("float16", AVX2 | {"avx512_fp16"}, GIB, 16 * GIB).dtype == "float16"
    assert choose_cpu_dtype("float16", AVX2 | {"avx512_bf16"}, GIB, 16 * GIB).dtype == "float32"


def test_emulated_bf16_becomes_float32_when_it_fits():
    choice = choose_cpu_dtype("bfloat16", AVX2, 6 * GIB, 16 * GIB)
    assert choice.dtype == "float32" and "emulated" in choice.reason


def test_emulated_bf16_is_kept_and_says_why_when_float32_does_not_fit():
    choice = choose_cpu_dtype("bfloat16", AVX2, 14 * GIB, 16 * GIB)  # over 80% of the RAM
    assert choice.dtype == "bfloat16" and "not fit" in choice.reason


def test_a_float32_checkpoint_stays_float32():
    assert choose_cpu_dtype("float32", AVX2, 100 * GIB, GIB).dtype == "float32"


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    path = build_tiny_qwen3(tmp_path_factory.mktemp("bf16") / "m", num_layers=1)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(path / "model.safetensors").items()}
    save_file(weights, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return str(path)


def test_engine_on_this_cpu_picks_what_the_choice_says(bf16_checkpoint, caplog):
    expected = choose_cpu_dtype("bfloat16", cpu_flags(), 4 * GIB, physical_memory()).dtype
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        with LLM(
            bf16_checkpoint,
            device="cpu",
            num_kvcache_blocks=8,
            kvcache_block_size=16,
            cpu_kvcache_space_gib=4,
        ) as llm:
            assert llm.model_runner.dtype == getattr(torch, expected)
    assert any(f"dtype=auto on this CPU: {expected}" in r.message for r in caplog.records)


def test_an_explicit_dtype_is_obeyed(bf16_checkpoint):
    with LLM(
        bf16_checkpoint, device="cpu", dtype="bfloat16", num_kvcache_blocks=8, kvcache_block_size=16
    ) as llm:
        assert llm.model_runner.dtype == torch.bfloat16


FAULTS_OF_A_REUSED_TENSOR = """
import resource, sys, torch
from nanovllm.platforms.cpu.host import keep_freed_host_memory
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
x = y = torch.ones(16384, 768)  # a prefill's MLP activation: 48 MiB
x * y  # its product freed: the heap has grown to hold it
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x * y
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_host_memory_is_reused_without_page_faults():
    """A CPU runner keeps freed memory in the heap: the next activation of that size is
    not faulted in page by page again (12,288 4-KiB pages here)."""

    def faults(mode: str) -> int:
        proc = subprocess.run(
            [sys.executable, "-c", FAULTS_OF_A_REUSED_TENSOR, mode],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return int(proc.stdout.split()[-1])

    assert faults("default") > 10_000  # glibc unmaps a freed 64 MiB block: every page again
    assert faults("keep") < 1_000
