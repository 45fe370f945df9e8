"""The CPU's native decode step against the eager layers, decode step by decode step: one process
holds both engines (the same random weights; `cpu_decode_step=False` for the eager one), each with
`--rows` sequences of a 128-token prompt decoding, and times their `step()` in turn, a block of 4
steps each, so that the machine's drift falls on both. Prints the median step of each and their
ratio (docs/cpu.md#the-native-decode-step).

    OMP_NUM_THREADS=1 python benchmarks/cpu_native_step.py --shape qwen3-0.6b --rows 1 2 3 4
    OMP_NUM_THREADS=2 python benchmarks/cpu_native_step.py --shape cpu-small --rows 1 4 8 16
"""

import argparse
import os
import statistics
import tempfile
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.demo import QWEN3_0_6B_CONFIG, write_weightless_checkpoint

CPU_SMALL = dict(  # bench.py's cpu-small shape on Qwen3-0.6B's config
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=4096,
)
SHAPES = {"qwen3-0.6b": QWEN3_0_6B_CONFIG, "cpu-small": QWEN3_0_6B_CONFIG | CPU_SMALL}
BLOCK = 4  # steps of one engine before the other's


def decoding(path: str, rows: int, native: bool) -> LLM:
    """An engine whose `rows` sequences are past their prompts."""
    llm = LLM(
        path,
        load_format="dummy",
        dtype="float32",
        max_model_len=1024,
        num_kvcache_blocks=64,
        cpu_decode_step=native,
    )
    assert (llm.model_runner.fast_decode is not None) == native
    params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
    for row in range(rows):
        llm.add_request([5 + row] * 128, params)
    while llm.step().num_prefill_tokens or llm.stats().num_waiting:
        pass
    return llm


def measure(path: str, rows: int, blocks: int) -> dict[str, float]:
    """Median ms of a decode step, native and eager."""
    engines = {"native": decoding(path, rows, True), "eager": decoding(path, rows, False)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(blocks):
        for name, llm in engines.items():
            for _ in range(BLOCK):
                start = time.perf_counter()
                llm.step()
                times[name].append(time.perf_counter() - start)
    for llm in engines.values():
        llm.close()
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu-small")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--blocks", type=int, default=20, help="blocks of 4 steps of each engine")
    args = p.parse_args()
    path = str(write_weightless_checkpoint(tempfile.mkdtemp(), SHAPES[args.shape]))
    print(f"{args.shape}, {torch.get_num_threads()} thread(s), median ms per decode step")
    for rows in args.rows:
        ms = measure(path, rows, args.blocks)
        load = os.getloadavg()[0]
        print(
            f"rows {rows:3}: native {ms['native']:8.2f}  eager {ms['eager']:8.2f}  "
            f"eager / native {ms['eager'] / ms['native']:.2f}x  (load {load:.2f})"
        )


if __name__ == "__main__":
    main()
