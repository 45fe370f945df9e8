"""Time CPU decode attention: the native paged kernel (kernels/cpu_decode.py) against the
torch backend's gathering path, interleaved, on one layer of a decode step.

    python benchmarks/cpu_decode_attention.py [--threads 1]

Shapes: cpu-small's attention (4 query heads, 2 KV heads, head_dim 64, float32) and
Qwen3-0.6B's (16 / 8 / 128, float32 and bfloat16), 256-token blocks, context lengths
uniform in [16, 512). Prints the 1-minute load average: other work on the cores skews
both columns alike, since they alternate.
"""

import argparse
import os
import time

import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchBackend

SHAPES = {
    "cpu-small f32": (4, 2, 64, torch.float32),
    "0.6b f32": (16, 8, 128, torch.float32),
    "0.6b bf16": (16, 8, 128, torch.bfloat16),
}
BLOCK = 256


def decode_step(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype):
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(16, 512, (num_seqs,), generator=g, dtype=torch.int32)
    blocks = -(-lens // BLOCK)
    num_blocks = int(blocks.sum())
    cache = [
        torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g).to(dtype)
        for _ in range(2)
    ]
    ids = torch.randperm(num_blocks, generator=g).int()
    tables = torch.full((num_seqs, int(blocks.max())), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks.tolist()):
        tables[i, :n] = ids[start : start + n]
        start += n
    ctx = AttentionMetadata(block_tables=tables, context_lens=lens)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g).to(dtype)
    return q, cache[0], cache[1], ctx


def time_ms(backend: TorchBackend, args: tuple, repeats: int) -> float:
    backend.decode(*args, scale=0.1)  # warm (plans, first-use build)
    best = float("inf")
    for _ in range(repeats):
        backend._decode_step = None  # every layer call of a real step after the first reuses it
        start = time.perf_counter()
        backend.decode(*args, scale=0.1)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    native, gathering = TorchBackend(), TorchBackend(native_cpu_decode=False)
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'shape':>14} {'seqs':>5} {'native ms':>10} {'gather ms':>10} {'speedup':>8}")
    for name, shape in SHAPES.items():
        for num_seqs in (8, 32, 128):
            step = decode_step(num_seqs, *shape)
            a, b = time_ms(native, step, args.repeats), time_ms(gathering, step, args.repeats)
            print(f"{name:>14} {num_seqs:>5} {a:>10.3f} {b:>10.3f} {b / a:>7.2f}x")


if __name__ == "__main__":
    main()
