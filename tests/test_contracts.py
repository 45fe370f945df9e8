"""The layer contracts, as tests: import-linter's (pyproject.toml, one line each
saying why), and what an import graph cannot see, checked on the syntax tree: the entry points
and the server's front (engine/async_engine.py) use only the engine's public API."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanovllm"
# The engine's clients: they may call what LLMEngine offers, nothing under it.
CLIENTS = sorted((PACKAGE / "entrypoints").glob("*.py")) + [PACKAGE / "engine" / "async_engine.py"]
INTERNALS = {"scheduler", "model_runner", "block_manager"}  # the planes under the engine


def lint_imports() -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("lint-imports")
    command = [str(script)] if script.exists() else [shutil.which("lint-imports") or "lint-imports"]
    return subprocess.run([*command, "--no-cache"], cwd=ROOT, capture_output=True, text=True)


def test_import_linter_keeps_every_layer_contract():
    result = lint_imports()
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def own_attributes(cls: ast.ClassDef) -> set[str]:
    """Names a class defines: its methods and class attributes, and what its code assigns to
    self.<name>; a base class of the package's own defines none here (they are the engine's)."""
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Name) and node in cls.body:
                names.add(target.id)
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                names.add(target.attr)
    return names


def private_uses(path: Path, root: Path = ROOT) -> list[str]:
    """Each `x._name` in the file that is not the class's own `self._name`, and each reach
    into the planes under the engine (`.scheduler`, `.model_runner`, `.block_manager`)."""
    tree = ast.parse(path.read_text())
    found = []
    classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    owner = {id(n): cls for cls in classes for n in ast.walk(cls)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name, where = node.attr, f"{path.relative_to(root)}:{node.lineno} .{node.attr}"
        if name in INTERNALS:
            found.append(where)
        if not name.startswith("_") or name.startswith("__"):
            continue
        cls = owner.get(id(node))
        is_self = isinstance(node.value, ast.Name) and node.value.id == "self"
        if not (is_self and cls is not None and name in own_attributes(cls)):
            found.append(where)
    return found


@pytest.mark.parametrize("path", CLIENTS, ids=lambda p: p.name)
def test_the_engines_clients_use_only_its_public_api(path):
    assert private_uses(path) == []


def test_the_private_use_check_can_fail(tmp_path):
    client = tmp_path / "client.py"
    client.write_text(
        "class LLM(LLMEngine):\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def go(self):\n"
        "        self._mine, self._queue(), self.engine._check_open()\n"
        "        return self.engine.scheduler.running\n"
    )
    uses = sorted(use.rsplit(" ", 1)[1] for use in private_uses(client, tmp_path))
    assert uses == ["._check_open", "._queue", ".scheduler"]
