"""The skeleton: the modules a default offline run imports, `LLM(path).generate(prompts)` on a
plain Qwen3 checkpoint (bfloat16 and tied embeddings, as Qwen3-0.6B's; random weights) in a
fresh interpreter, plus runner/cuda_graph.py, which every GPU run uses. Everything else is a
seam, imported only when switched on. Prints them in reading order with their lines (the
files are as `ruff format` writes them: tests/test_style.py), kernels/ apart, and the total.

    python scripts/skeleton.py              # the README's "Read the code" table
    python scripts/skeleton.py --check 3500 # exit 1 above 3,500 lines
    python scripts/skeleton.py --readme     # write the table and its total into README.md
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALSO_COUNTED = ["nanovllm/runner/cuda_graph.py"]  # not imported on a CPU; every GPU run uses it
# Where a newcomer starts and how the engine unfolds from there; a module that is imported but
# not listed comes last (and a test asks for it to be placed).
READING_ORDER = [
    "nanovllm/__init__.py",
    "nanovllm/entrypoints/llm.py",
    "nanovllm/sampling_params.py",
    "nanovllm/outputs.py",
    "nanovllm/config.py",
    "nanovllm/engine/llm_engine.py",
    "nanovllm/core/sequence.py",
    "nanovllm/core/scheduler.py",
    "nanovllm/core/block_manager.py",
    "nanovllm/runner/model_runner.py",
    "nanovllm/runner/step_inputs.py",
    "nanovllm/runner/kv_cache.py",
    "nanovllm/runner/cuda_graph.py",
    "nanovllm/runner/cpu.py",
    "nanovllm/runner/cpu_threads.py",
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
    "nanovllm/sampling/metadata.py",
    "nanovllm/sampling/sampler.py",
    "nanovllm/sampling/ops.py",
    "nanovllm/distributed/group.py",
    "nanovllm/compilation.py",
    "nanovllm/device.py",
    "nanovllm/utils.py",
]
PROBE = """
import json, sys
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1])
llm.generate(["Hello, my name is", "The capital of France is"], SamplingParams(max_tokens=8))
llm.close()
files = [getattr(m, "__file__", None) for name, m in list(sys.modules.items())
         if name == "nanovllm" or name.startswith("nanovllm.")]
print(json.dumps(sorted(f for f in files if f)))
"""


def plain_qwen3_checkpoint(path: Path) -> Path:
    """A tiny random Qwen3 written as Qwen3-0.6B's is: tied embeddings, transformers-4 keys,
    bfloat16."""
    from nanovllm.demo import build_tiny_qwen3

    build_tiny_qwen3(path, tie_word_embeddings=True, config_style="transformers4")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, torch_dtype="bfloat16"), indent=2))
    return path


def imported_files(checkpoint: Path) -> list[Path]:
    """The package's files a default run imports, in a fresh interpreter."""
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, str(checkpoint)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return [Path(f).resolve() for f in json.loads(probe.stdout.strip().splitlines()[-1])]


def measure() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(the skeleton's files in reading order, kernels/'s), each with its line count."""
    with tempfile.TemporaryDirectory() as tmp:
        files = imported_files(plain_qwen3_checkpoint(Path(tmp) / "qwen3"))
    names = {str(f.relative_to(ROOT)) for f in files} | set(ALSO_COUNTED)
    kernels = sorted(n for n in names if n.startswith("nanovllm/kernels/"))
    skeleton = [n for n in READING_ORDER if n in names]
    skeleton += sorted(names - set(skeleton) - set(kernels) - set(READING_ORDER))

    def lines(name: str) -> int:
        return len((ROOT / name).read_text().splitlines())

    return [(n, lines(n)) for n in skeleton], [(n, lines(n)) for n in kernels]


def table(skeleton: list[tuple[str, int]]) -> str:
    rows = [
        f"| {i} | `{name.removeprefix('nanovllm/')}` | {n} |"
        for i, (name, n) in enumerate(skeleton, 1)
    ]
    total = sum(n for _, n in skeleton)
    return "\n".join(["| # | module | lines |", "|---|---|---|", *rows, f"| | total | {total} |"])


def update_readme(skeleton: list[tuple[str, int]]) -> None:
    """The README's table, and the total its text gives, as measured."""
    path = ROOT / "README.md"
    readme = path.read_text()
    start = readme.index("| # | module | lines |")
    end = readme.index("\n\n", start)
    readme = readme[:start] + table(skeleton) + readme[end:]
    total = sum(n for _, n in skeleton)
    readme = re.sub(
        r"every GPU run uses: [\d,]+ lines", f"every GPU run uses: {total:,} lines", readme
    )
    path.write_text(readme)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", type=int, help="exit 1 if the skeleton has more lines")
    parser.add_argument("--readme", action="store_true", help="update README.md's table")
    args = parser.parse_args()
    skeleton, kernels = measure()
    print(table(skeleton))
    if args.readme:
        update_readme(skeleton)
    kernel_lines = sum(n for _, n in kernels)
    print(f"\nkernels/ (not counted): {len(kernels)} files, {kernel_lines} lines")
    total = sum(n for _, n in skeleton)
    if args.check is not None and total > args.check:
        print(f"the skeleton has {total} lines, more than {args.check}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
