"""The default path is the skeleton (scripts/skeleton.py measures it): a default offline run
imports at most 3,500 formatted lines outside kernels/, none of the optional capabilities, and
the README's "Read the code" table is that measurement."""

import importlib.util
import re
from pathlib import Path

import pytest
from conftest import HAS_COMPILER

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 3500
# Each imported only when switched on (or, for the gathered decode, where the C++ one cannot be).
OPTIONAL = [
    "nanovllm/attention/flash_attn_backend.py",
    "nanovllm/attention/triton_backend.py",
    "nanovllm/demo.py",
    "nanovllm/distributed/collectives.py",
    "nanovllm/distributed/data_parallel.py",
    "nanovllm/distributed/launch.py",
    "nanovllm/distributed/workers.py",
    "nanovllm/engine/async_engine.py",
    "nanovllm/engine/detokenizer.py",
    "nanovllm/engine/overlap.py",
    "nanovllm/entrypoints/cli.py",
    "nanovllm/entrypoints/guards.py",
    "nanovllm/entrypoints/metrics.py",
    "nanovllm/entrypoints/openai_server.py",
    "nanovllm/entrypoints/protocol.py",
    "nanovllm/entrypoints/responses.py",
    "nanovllm/entrypoints/tokenization.py",
    "nanovllm/layers/rope_scaling.py",
    "nanovllm/models/dummy.py",
    "nanovllm/layers/quantization.py",
    "nanovllm/kernels/cpu_int8.py",
    "nanovllm/models/llama.py",
    "nanovllm/models/mistral.py",
    "nanovllm/models/moe.py",
    "nanovllm/models/qwen2.py",
    "nanovllm/models/qwen3_moe.py",
    "nanovllm/runner/cuda.py",
    "nanovllm/sampling/bias.py",
    "nanovllm/sampling/filters.py",
    "nanovllm/sampling/logprobs.py",
    "nanovllm/sampling/penalties.py",
    "nanovllm/sampling/seeded.py",
    "nanovllm/structured/__init__.py",
    "nanovllm/structured/grammars.py",
    "nanovllm/structured/matchers.py",
    "nanovllm/structured/params.py",
] + (["nanovllm/attention/gathered_decode.py"] if HAS_COMPILER else [])


def load_script():
    spec = importlib.util.spec_from_file_location("skeleton", ROOT / "scripts" / "skeleton.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


skeleton_script = load_script()


@pytest.fixture(scope="module")
def measured() -> list[tuple[str, int]]:
    skeleton, _ = skeleton_script.measure()
    return skeleton


def test_a_default_run_imports_at_most_the_budget_outside_kernels(measured):
    total = sum(lines for _, lines in measured)
    assert 1000 < total <= BUDGET, skeleton_script.table(measured)


def test_no_optional_capability_is_imported_by_a_default_run(measured):
    names = {name for name, _ in measured}
    assert names.isdisjoint(OPTIONAL), sorted(names & set(OPTIONAL))
    assert all((ROOT / name).is_file() for name in OPTIONAL)  # the list names real modules


def test_every_skeleton_module_has_its_place_in_the_reading_order(measured):
    unplaced = [
        name
        for name, _ in measured
        if name not in skeleton_script.READING_ORDER and not name.endswith("__init__.py")
    ]
    assert unplaced == []


def test_the_readme_table_is_the_measurement(measured):
    readme = (ROOT / "README.md").read_text()
    start = readme.index("| # | module | lines |")
    listed = readme[start : readme.index("\n\n", start)]
    assert listed == skeleton_script.table(measured), "run python scripts/skeleton.py"
    total = sum(lines for _, lines in measured)
    assert re.search(rf"\b{total:,}\b", readme[:start]), "the README's text names the total"
