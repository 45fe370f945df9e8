#!/usr/bin/env bash
# One command for a CUDA GPU box: nanovllm's CUDA tests and benchmarks, ending in a
# short table (scripts/gpu_check.py says what runs). Needs only an image with torch,
# triton, transformers, xxhash, safetensors and tqdm; no network, nothing is installed.
#
#   scripts/gpu_check.sh [--out DIR]      # logs and summary.json go to DIR ($OUT if set)
#
# pytest is not in every image. To run the tests there anyway, install a copy into the
# repository beforehand, on any machine with the same Python minor version:
#   python -m pip install --target .gpu_deps pytest      (.gpu_deps is git-ignored)
# and bring .gpu_deps along; this script puts it on the path.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .gpu_deps ]; then
    export PYTHONPATH="$PYTHONPATH:$PWD/.gpu_deps"
fi
# The first interpreter that imports torch (an image's torch may live behind python3 only).
if [ -z "${PYTHON:-}" ]; then
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
            PYTHON=$(command -v "$candidate")
            break
        fi
    done
fi
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
