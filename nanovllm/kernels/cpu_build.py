"""Builds and loads the CPU kernels written in C++ (cpu_decode.cpp, cpu_ops.cpp, cpu_sample.cpp).
They have no PyTorch headers: compiled with the system's C++ compiler at first use in a few seconds
(torch.utils.cpp_extension would take a minute), for this CPU (-march=native), cached under
~/.cache/nanovllm keyed by the source, the flags and the CPU, and loaded with ctypes. Their
OpenMP threads are PyTorch's own: a library links libgomp.so.1, which the process already
holds, loaded by libtorch.

`load_library` is None, with one warning saying why, when no compiler is found or the build
fails; the caller then falls back to PyTorch (and says how in the warning).

A process's first build says so first, on the "nanovllm" logger at WARNING: the level Python
shows with no logging configured, so a first run does not look stalled. A default CPU run builds
cpu_ops, cpu_sample and cpu_decode: 4.9 s together on a 2-core AMD EPYC (1.4, 0.2 and 3.3 s; int8
weights add cpu_int8, 4.0 s; int4 weights cpu_int4, 1.3 s of CPU).
"""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

FIRST_BUILD_S = 5  # a default run's builds (module docstring)


def native_flags(*math: str) -> tuple[str, ...]:
    """Every library's flags: optimized for this CPU, OpenMP, a shared object; `math`, its own
    floating-point flags (-ffp-contract=fast, -fno-trapping-math, ...), between."""
    return ("-O3", "-march=native", *math, "-fopenmp", "-shared", "-fPIC", "-std=c++17")


def load_library(source: Path, flags: tuple[str, ...], fallback: str) -> ctypes.CDLL | None:
    """The library compiled from `source`, built on first use; None (and a warning ending
    with `fallback`, what runs instead) if it cannot be."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return _unavailable(source, "no C++ compiler (g++ or c++, or $CXX) was found", fallback)
    try:
        path = _cache_dir() / f"{source.stem}-{_build_key(source, compiler, flags)}.so"
        if not path.exists():
            _announce_first_build(path.parent)
            _compile(source, compiler, flags, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or str(error)
        return _unavailable(source, f"building or loading it failed: {detail[-800:]}", fallback)


@functools.cache  # once a process: the libraries a run builds are one wait to the user
def _announce_first_build(cache: Path) -> None:
    logging.getLogger("nanovllm").warning(
        "compiling the CPU kernels (once, cached under %s): ~%d s", cache, FIRST_BUILD_S
    )


def _unavailable(source: Path, reason: str, fallback: str) -> None:
    logging.getLogger("nanovllm").warning(
        "the CPU kernels of %s are unavailable (%s); %s", source.name, reason, fallback
    )
    return None


def _build_key(source: Path, compiler: str, flags: tuple[str, ...]) -> str:
    """Source (and the headers beside it, which it may include), compiler, flags and this
    CPU (-march=native code may not run on another)."""
    cpu = ""
    if os.path.exists("/proc/cpuinfo"):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "".join(x for x in lines if x.startswith(("model name", "flags")))[:4096]
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    text = "\n".join((source.read_text(), *headers, compiler, *flags, cpu))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root) / "nanovllm" / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compile(source: Path, compiler: str, flags: tuple[str, ...], path: Path) -> None:
    """Build into a temporary file, then rename: concurrent first uses never load half a file."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        subprocess.run(
            [compiler, *flags, str(source), "-o", str(built)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(built, path)
