"""Docs that cannot drift: every module of the package is named in docs/architecture.md's folder
table, and every file path the docs and the README name exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanovllm"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SOURCES = (".py", ".cpp", ".h")
# A path in backticks: folders and a file name with a suffix (a glob or a placeholder is not one).
PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|cpp|h|sh|md|toml|json))`")


def folder_table() -> dict[str, str]:
    """docs/architecture.md's folder table: folder -> the text of its row."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `([\w/]+)/` \| (.+) \|$", text, re.MULTILINE)
    return {folder.removeprefix("nanovllm"): row for folder, row in rows}


def named_modules(table: dict[str, str]) -> set[str]:
    """Each module the table names, as a path under nanovllm/: `x.py` in a folder's row, and in
    its sub-folders' parts of the row (`cpu/`: ... `host.py`)."""
    named = set()
    for folder, row in table.items():
        base = folder.strip("/")
        for sub, part in re.findall(r"`(\w+)/`: ([^)]*)", row):
            named |= {f"{base}/{sub}/{name}" for name in re.findall(r"`([\w.]+)`", part)}
            row = row.replace(part, "")
        named |= {f"{base}/{name}".lstrip("/") for name in re.findall(r"`([\w.]+)`", row)}
    return named


def test_every_module_is_named_in_the_architecture_pages_folder_table():
    """A package's __init__.py is named by the page's "each package's __init__.py says what it
    holds", unless its row names it for more."""
    named = named_modules(folder_table())
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*") if p.suffix in SOURCES}
    assert sorted(m for m in modules - named if not m.endswith("__init__.py")) == []


def test_the_table_check_can_fail():
    table = {"/": "`config.py`", "platforms/": "the CPU's (`cpu/`: `host.py`) and `interface.py`"}
    assert named_modules(table) == {"config.py", "platforms/cpu/host.py", "platforms/interface.py"}


def resolves(path: str, doc: Path) -> bool:
    """A path as the docs write it: from the repository, the package, or the page's folder."""
    return any((base / path).exists() for base in (ROOT, PACKAGE, doc.parent))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_page_names_exists(doc):
    missing = [path for path in PATH.findall(doc.read_text()) if not resolves(path, doc)]
    assert missing == []
