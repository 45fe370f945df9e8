"""The default path is the skeleton (scripts/skeleton.py measures it, per platform): a default
offline run imports none of the optional capabilities, a CPU run nothing of CUDA's and a CUDA run
nothing of the CPU's, and the README's "Read the code" table is that measurement. No line count is
gated: the structure is."""

import importlib.util
from pathlib import Path

import pytest
from conftest import HAS_COMPILER

ROOT = Path(__file__).resolve().parent.parent
# Each imported only when switched on (or, for the gathered decode, where the C++ one cannot be).
OPTIONAL = [
    "nanovllm/demo.py",
    "nanovllm/distributed/collectives.py",
    "nanovllm/distributed/data_parallel.py",
    "nanovllm/distributed/launch.py",
    "nanovllm/distributed/workers.py",
    "nanovllm/engine/async_engine.py",
    "nanovllm/engine/detokenizer.py",
    "nanovllm/engine/overlap.py",
    "nanovllm/engine/speculative.py",
    "nanovllm/entrypoints/cli.py",
    "nanovllm/entrypoints/guards.py",
    "nanovllm/entrypoints/metrics.py",
    "nanovllm/entrypoints/openai_server.py",
    "nanovllm/entrypoints/protocol.py",
    "nanovllm/entrypoints/responses.py",
    "nanovllm/entrypoints/tokenization.py",
    "nanovllm/kernels/cpu_int4.py",
    "nanovllm/layers/rope_scaling.py",
    "nanovllm/lora/__init__.py",
    "nanovllm/lora/checkpoint.py",
    "nanovllm/lora/layers.py",
    "nanovllm/lora/manager.py",
    "nanovllm/lora/mapping.py",
    "nanovllm/lora/ops.py",
    "nanovllm/lora/request.py",
    "nanovllm/lora/scheduling.py",
    "nanovllm/models/dummy.py",
    "nanovllm/models/llama.py",
    "nanovllm/models/mistral.py",
    "nanovllm/models/moe.py",
    "nanovllm/models/qwen2.py",
    "nanovllm/models/qwen3_moe.py",
    "nanovllm/quantization/__init__.py",
    "nanovllm/quantization/int4.py",
    "nanovllm/quantization/int8.py",
    "nanovllm/sampling/bias.py",
    "nanovllm/sampling/filters.py",
    "nanovllm/sampling/logprobs.py",
    "nanovllm/sampling/penalties.py",
    "nanovllm/sampling/seeded.py",
    "nanovllm/sampling/verify.py",
    "nanovllm/speculative/__init__.py",
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
def measured():
    return skeleton_script.measure()


def test_no_optional_capability_is_imported_by_a_default_run(measured):
    assert all((ROOT / name).is_file() for name in OPTIONAL)  # the list names real modules
    for run in (measured.cpu, measured.cuda):
        assert run.isdisjoint(OPTIONAL), sorted(run & set(OPTIONAL))


def test_a_cpu_run_imports_nothing_of_cuda_and_a_cuda_run_nothing_of_the_cpu(measured):
    assert not {n for n in measured.cpu if "cuda" in n or "triton" in n or "flash" in n}
    cpu_own = [n for n in measured.cuda if "/cpu" in n or n.endswith("torch_backend.py")]
    assert cpu_own == []  # platforms/cpu/ (threads, host, decode_step), kernels/cpu_*
    assert "nanovllm/platforms/cpu/threads.py" in measured.cpu  # the check can fail
    assert "nanovllm/platforms/cuda/graphs.py" in measured.cuda


def test_every_skeleton_module_has_its_place_in_the_reading_order(measured):
    unplaced = [
        name
        for name in skeleton_script.reading_order(measured)
        if name not in skeleton_script.READING_ORDER and not name.endswith("__init__.py")
    ]
    assert unplaced == []


def test_the_readme_table_is_the_measurement(measured):
    readme = (ROOT / "README.md").read_text()
    start = readme.index("| # | module | lines |")
    listed = readme[start : readme.index("\n\n", start)]
    assert listed == skeleton_script.table(measured), "run python scripts/skeleton.py --readme"
