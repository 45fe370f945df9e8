"""The README's quick start: `python example.py` runs to completion on a fresh machine
(no model downloaded: it builds and uses the tiny demo checkpoint)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_example_runs_on_the_demo_checkpoint(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path))  # no ~/huggingface, no cached demo
    result = subprocess.run(
        [sys.executable, "example.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RANDOM demo checkpoint" in result.stdout
    assert result.stdout.count("Completion: ") == 2
    assert (tmp_path / ".cache" / "nanovllm").is_dir()
