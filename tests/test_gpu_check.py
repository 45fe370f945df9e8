"""scripts/gpu_check.sh, the one command for a GPU box, as far as a CPU can take it: it
reports that no GPU is present and exits cleanly; and the CUDA tests it selects with
`-m cuda` are all the tests that need CUDA."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: it would run it all")
def test_without_a_gpu_it_says_so_and_exits_cleanly(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert load_gpu_check().NO_GPU in lines
    assert any(
        line.startswith("versions") and f"torch {torch.__version__}" in line for line in lines
    )
    assert lines[-1] == "-" * 78  # the table comes last


def test_it_runs_the_files_with_cuda_tests_and_no_others():
    files = load_gpu_check().cuda_test_files()
    assert "tests/test_cuda.py" in files and "tests/kernels/test_paged_attention.py" in files
    assert "tests/test_scheduler_properties.py" not in files  # hypothesis may be missing


class _Collected:
    def __init__(self):
        self.items = []

    def pytest_collection_modifyitems(self, items):
        self.items = list(items)


def test_every_test_that_skips_without_cuda_carries_the_cuda_mark():
    collected = _Collected()
    pytest.main(
        ["--collect-only", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")], plugins=[collected]
    )

    def skips_without_cuda(item) -> bool:
        return any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))

    assert len(collected.items) > 100
    unmarked = [
        item.nodeid
        for item in collected.items
        if skips_without_cuda(item) and item.get_closest_marker("cuda") is None
    ]
    assert unmarked == []
