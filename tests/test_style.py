"""The formatter and the linter own the code's shape (pyproject.toml's [tool.ruff]): a change that
`ruff format` would rewrite, or that `ruff check` flags, fails the suite."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_every_file_is_as_ruff_format_writes_it():
    result = ruff("format", "--check", "--diff", ".")
    assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout[-4000:]}{result.stderr}"


def test_ruff_check_finds_nothing():
    result = ruff("check", "--output-format", "concise", ".")
    assert result.returncode == 0, f"`ruff check .` found:\n{result.stdout[-4000:]}{result.stderr}"
