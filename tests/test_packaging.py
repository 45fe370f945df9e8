"""The built wheel holds every subpackage: build it, install it into a scratch
directory, and import every module from there (not from the source tree)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_contains_and_imports_every_module(tmp_path):
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        pip
        + [
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
    )
    wheel = next((tmp_path / "dist").glob("nano_vllm-*.whl"))
    target = tmp_path / "site"
    subprocess.run(
        pip + ["install", "-q", "--no-deps", "--target", str(target), str(wheel)], check=True
    )
    sources = sorted(
        p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        for p in (ROOT / "nanovllm").rglob("*.py")
    )
    modules = [m.removesuffix(".__init__") for m in sources]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(target)!r}), module.__file__\n"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    kernels = ROOT / "nanovllm" / "kernels"  # the C++ sources, compiled at first use
    for source in [*kernels.glob("*.cpp"), *kernels.glob("*.h")]:
        assert (target / "nanovllm" / "kernels" / source.name).is_file(), source.name
    # `nanovllm serve ...`: the console script the wheel installs
    entry_points = next(target.glob("nano_vllm-*.dist-info")) / "entry_points.txt"
    assert "nanovllm = nanovllm.entrypoints.cli:main" in entry_points.read_text()
