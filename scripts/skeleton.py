"""The skeleton: the modules a default offline run imports, `LLM(path).generate(prompts)` on a
plain Qwen3 checkpoint (bfloat16 and tied embeddings, as Qwen3-0.6B's; random weights), per
platform. Everything else is a seam, imported only when switched on. Prints them in reading
order with their lines (as `ruff format` writes them: tests/test_style.py) and which platform's
run imports each, kernels/ apart.

    a CPU run    measured: the run itself, in a fresh interpreter
    a CUDA run   simulated on any machine: the CPU run's modules that are not the CPU's own
                 (CPU_ONLY), with what importing the CUDA platform and its attention backends
                 brings in a fresh interpreter (CUDA_ENTRY)

    python scripts/skeleton.py              # the README's "Read the code" table
    python scripts/skeleton.py --readme     # write the table into README.md
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
# What only a CPU run imports (the CUDA platform and its backends take their place on a GPU).
CPU_ONLY = ("nanovllm/platforms/cpu/", "nanovllm/attention/torch_backend.py")
# What a CUDA run imports beyond the CPU run's common modules: its platform, and the attention
# backends "auto" tries (flash_attn_backend.py answers why not where flash-attn is absent).
CUDA_ENTRY = [
    "nanovllm.platforms.cuda",
    "nanovllm.attention.flash_attn_backend",
    "nanovllm.attention.triton_backend",
]
# Where a newcomer starts and how the engine unfolds from there; a module that is imported but
# not listed comes last (and a test asks for it to be placed).
READING_ORDER = [
    "nanovllm/__init__.py",
    "nanovllm/entrypoints/llm.py",
    "nanovllm/sampling_params.py",
    "nanovllm/outputs.py",
    "nanovllm/config.py",
    "nanovllm/engine/llm_engine.py",
    "nanovllm/engine/loop.py",
    "nanovllm/core/sequence.py",
    "nanovllm/core/scheduler.py",
    "nanovllm/core/block_manager.py",
    "nanovllm/runner/model_runner.py",
    "nanovllm/runner/step_inputs.py",
    "nanovllm/runner/kv_cache.py",
    "nanovllm/runner/warmup.py",
    "nanovllm/platforms/__init__.py",
    "nanovllm/platforms/interface.py",
    "nanovllm/platforms/cpu/__init__.py",
    "nanovllm/platforms/cpu/host.py",
    "nanovllm/platforms/cpu/threads.py",
    "nanovllm/platforms/cpu/ops.py",
    "nanovllm/platforms/cpu/weights.py",
    "nanovllm/platforms/cpu/decode_step.py",
    "nanovllm/platforms/cuda/__init__.py",
    "nanovllm/platforms/cuda/memory.py",
    "nanovllm/platforms/cuda/graphs.py",
    "nanovllm/models/registry.py",
    "nanovllm/models/qwen3.py",
    "nanovllm/models/decoder.py",
    "nanovllm/models/hf_config.py",
    "nanovllm/models/loader.py",
    "nanovllm/layers/linear.py",
    "nanovllm/layers/embed_head.py",
    "nanovllm/layers/layernorm.py",
    "nanovllm/layers/rotary_embedding.py",
    "nanovllm/layers/activation.py",
    "nanovllm/layers/attention.py",
    "nanovllm/attention/metadata.py",
    "nanovllm/attention/backend.py",
    "nanovllm/attention/torch_backend.py",
    "nanovllm/attention/flash_attn_backend.py",
    "nanovllm/attention/triton_backend.py",
    "nanovllm/sampling/metadata.py",
    "nanovllm/sampling/sampler.py",
    "nanovllm/sampling/ops.py",
    "nanovllm/distributed/group.py",
    "nanovllm/compilation.py",
    "nanovllm/device.py",
    "nanovllm/utils.py",
]
RUN_PROBE = """
import json, sys
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1])
llm.generate(["Hello, my name is", "The capital of France is"], SamplingParams(max_tokens=8))
llm.close()
"""
IMPORT_PROBE = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
"""
LIST_MODULES = """
files = [getattr(m, "__file__", None) for name, m in list(sys.modules.items())
         if name == "nanovllm" or name.startswith("nanovllm.")]
print(json.dumps(sorted(f for f in files if f)))
"""


class Skeleton(NamedTuple):
    cpu: set[str]  # the package's files a default CPU run imports, kernels/ included
    cuda: set[str]  # ... a default CUDA run


def plain_qwen3_checkpoint(path: Path) -> Path:
    """A tiny random Qwen3 written as Qwen3-0.6B's is: tied embeddings, transformers-4 keys,
    bfloat16."""
    from nanovllm.demo import build_tiny_qwen3

    build_tiny_qwen3(path, tie_word_embeddings=True, config_style="transformers4")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, torch_dtype="bfloat16"), indent=2))
    return path


def imported_files(probe: str, *args: str) -> set[str]:
    """The package's files (relative to the repository) that `probe` imports, in a fresh
    interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", "import json, sys\n" + probe + LIST_MODULES, *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    files = json.loads(out.stdout.strip().splitlines()[-1])
    return {str(Path(f).resolve().relative_to(ROOT)) for f in files}


def measure() -> Skeleton:
    with tempfile.TemporaryDirectory() as tmp:
        cpu = imported_files(RUN_PROBE, str(plain_qwen3_checkpoint(Path(tmp) / "qwen3")))
    common = {name for name in cpu if not name.startswith((*CPU_ONLY, "nanovllm/kernels/"))}
    return Skeleton(cpu, common | imported_files(IMPORT_PROBE, *CUDA_ENTRY))


def lines(name: str) -> int:
    return len((ROOT / name).read_text().splitlines())


def reading_order(skeleton: Skeleton) -> list[str]:
    """Every module outside kernels/ either run imports, in reading order."""
    names = {n for n in skeleton.cpu | skeleton.cuda if not n.startswith("nanovllm/kernels/")}
    return [n for n in READING_ORDER if n in names] + sorted(names - set(READING_ORDER))


def table(skeleton: Skeleton) -> str:
    rows = ["| # | module | lines | imported by |", "|---|---|---|---|"]
    for i, name in enumerate(reading_order(skeleton), 1):
        where = {(True, True): "both", (True, False): "CPU", (False, True): "CUDA"}[
            (name in skeleton.cpu, name in skeleton.cuda)
        ]
        rows.append(f"| {i} | `{name.removeprefix('nanovllm/')}` | {lines(name)} | {where} |")
    for platform, names in (("CPU", skeleton.cpu), ("CUDA", skeleton.cuda)):
        total = sum(lines(n) for n in reading_order(skeleton) if n in names)
        rows.append(f"| | a {platform} run | {total} | |")
    return "\n".join(rows)


def update_readme(skeleton: Skeleton) -> None:
    path = ROOT / "README.md"
    readme = path.read_text()
    start = readme.index("| # | module | lines |")
    end = readme.index("\n\n", start)
    path.write_text(readme[:start] + table(skeleton) + readme[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="store_true", help="update README.md's table")
    args = parser.parse_args()
    skeleton = measure()
    print(table(skeleton))
    if args.readme:
        update_readme(skeleton)
    for platform, names in (("CPU", skeleton.cpu), ("CUDA", skeleton.cuda)):
        kernels = sorted(n for n in names if n.startswith("nanovllm/kernels/"))
        listed = ", ".join(Path(n).name for n in kernels)
        print(f"\nkernels/ a {platform} run imports: {listed} ({sum(map(lines, kernels))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
