"""The README's quick start: `python example.py` runs to completion on a fresh machine
(no model downloaded: it builds and uses the tiny demo checkpoint), and the download command it
names for a real model is one this environment has."""

import os
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from conftest import imported_modules

from nanovllm.demo import DEMO_DIR, DOWNLOAD_COMMAND, is_demo_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
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
    assert "RANDOM demo checkpoint" in result.stdout and DOWNLOAD_COMMAND in result.stdout
    assert result.stdout.count("Completion: ") == 2
    assert is_demo_checkpoint(tmp_path / ".cache" / "nanovllm" / DEMO_DIR.name)


def test_a_missing_model_dir_is_told_before_torch_is_imported(tmp_path):
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "example.py", str(missing)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert f"no model at {str(missing)!r}" in result.stderr and DOWNLOAD_COMMAND in result.stderr
    assert "torch" not in imported_modules(result.stderr)


def test_the_download_command_is_installed_and_takes_its_options(tmp_path):
    program, command, *arguments = shlex.split(DOWNLOAD_COMMAND)
    assert program in {ep.name for ep in entry_points(group="console_scripts")}
    # the console script installed beside this interpreter (a venv's bin/), else on PATH
    path = shutil.which(program, path=os.path.dirname(sys.executable)) or shutil.which(program)
    assert path is not None, f"{program} is not installed"
    result = subprocess.run(
        [path, command, "--help"],
        env=dict(os.environ, HOME=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    for option in (a for a in arguments if a.startswith("--")):
        assert option in result.stdout, f"`{program} {command}` has no {option}"


def test_the_readme_and_docs_name_the_download_command_and_no_other():
    readme = (ROOT / "README.md").read_text()
    assert DOWNLOAD_COMMAND in readme
    for path in [ROOT / "README.md", ROOT / "example.py", *(ROOT / "docs").glob("*.md")]:
        assert "huggingface-cli" not in path.read_text(), path  # removed in huggingface_hub 1.0
