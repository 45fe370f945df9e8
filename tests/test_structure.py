"""The structure the design asks for, read off the syntax trees (nothing is imported): no import
cycle between modules, counting imports inside functions and under TYPE_CHECKING (import-linter,
in test_contracts.py, holds the packages' layers); and no device branch in the rooms that must
not ask which device they are on (the platform answers for them, platforms/)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanovllm"
DEVICE_AGNOSTIC = [
    PACKAGE / "runner" / "model_runner.py",
    *(PACKAGE / "engine").glob("*.py"),
    *(PACKAGE / "core").glob("*.py"),
    *(PACKAGE / "layers").glob("*.py"),
    *(PACKAGE / "models").glob("*.py"),
    *(PACKAGE / "sampling").glob("*.py"),
    *(PACKAGE / "entrypoints").glob("*.py"),
]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The package's modules `path` imports anywhere in it: `from a.b import c` is a.b.c where
    that is a module, else a.b."""
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules and name != here}


def import_graph(root: Path = ROOT, package: str = "nanovllm") -> dict[str, set[str]]:
    paths = sorted((root / package).rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    return {module_name(p, root): imports_of(p, modules, root) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_function_level_and_type_checking_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n"
    )
    (package / "c.py").write_text("from . import a\n")
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b", "pkg.c"]]


def device_branches(path: Path, root: Path = ROOT) -> list[str]:
    """Where a file asks which device it is on: `.is_cuda`, `.is_cpu`, the `.type` of a device
    (`x.device.type`, `torch.get_default_device().type`), or `torch.cuda`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        text = ast.unparse(node)
        is_device_type = node.attr == "type" and "device" in ast.unparse(node.value)
        if node.attr in ("is_cuda", "is_cpu") or is_device_type or text == "torch.cuda":
            found.append(f"{path.relative_to(root)}:{node.lineno} {text}")
    return found


def test_device_agnostic_code_never_asks_which_device_it_is_on():
    assert DEVICE_AGNOSTIC and all(path.is_file() for path in DEVICE_AGNOSTIC)
    assert [b for path in DEVICE_AGNOSTIC for b in device_branches(path)] == []


def test_the_device_branch_check_can_fail(tmp_path):
    path = tmp_path / "runner.py"
    path.write_text(
        "def f(x, self):\n"
        "    if x.is_cpu or self.device.type == 'cuda':\n"
        "        torch.cuda.empty_cache()\n"
        "    return torch.get_default_device().type\n"
    )
    found = sorted(b.split(" ", 1)[1] for b in device_branches(path, tmp_path))
    assert found == [
        "self.device.type",
        "torch.cuda",
        "torch.get_default_device().type",
        "x.is_cpu",
    ]
