"""Time the small ops between the matmuls on a CPU both ways, in alternating rounds: the eager
PyTorch ops of layers/ against their native twins (kernels/cpu_ops.py).

    python benchmarks/cpu_ops.py [--threads 1] [--dtype float32|bfloat16] [--rounds 15]

Shapes: (rows, hidden, heads, kv_heads, head_dim) of the tiny test model at 256 rows,
cpu-small at 128, Qwen3-0.6B at 32 and at 1; a prefill of 2048 rows of Qwen3-0.6B for the
threads question. Each round times every op eager then native (the median of many calls
each); the table gives the medians over the rounds, since this machine's speed drifts.
"""

import argparse
import os
import statistics
import time

import torch

from nanovllm.kernels import cpu_ops
from nanovllm.layers.layernorm import add_rms_norm, rms_norm
from nanovllm.layers.rotary_embedding import apply_rotary_emb, get_rope
from nanovllm.platforms.cpu.host import keep_freed_host_memory
from nanovllm.platforms.cpu.ops import NATIVE

SHAPES = {
    "tiny 256": (256, 32, 2, 1, 16),
    "cpu-small 128": (128, 256, 4, 2, 64),
    "0.6b 32": (32, 1024, 16, 8, 128),
    "0.6b 1": (1, 1024, 16, 8, 128),
    "0.6b prefill 2048": (2048, 1024, 16, 8, 128),
}


def op_args(rows: int, hidden: int, heads: int, kv_heads: int, head_dim: int, dtype):
    """Each op's (eager, native, args), inputs as the decoder makes them (q, k: views of qkv)."""
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(hidden, generator=g).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
    head_weight = torch.randn(head_dim, generator=g).to(dtype)
    cache = get_rope(head_dim, 4096, {"rope_theta": 1e6}).cos_sin_cache
    positions = torch.randint(0, 4096, (rows,), generator=g)
    return {
        "rms_norm": (rms_norm, (x, weight, 1e-6)),
        "add_rms_norm": (add_rms_norm, (x, residual, weight, 1e-6)),
        "q_norm": (rms_norm, (q, head_weight, 1e-6)),
        "rotary": (apply_rotary_emb, (positions, q, k, cache)),
    }


def median_us(fn, args: tuple, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    keep_freed_host_memory()
    torch.set_num_threads(args.threads)
    assert cpu_ops.load() is not None, "the native ops did not build"
    dtype = getattr(torch, args.dtype)
    print(f"threads {args.threads}, {args.dtype}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'shape':>18} {'op':>13} {'eager us':>9} {'native us':>10} {'speedup':>8}")
    for name, shape in SHAPES.items():
        for op, (hot, op_input) in op_args(*shape, dtype).items():
            calls = max(5, args.calls // (shape[0] // 128 + 1))
            eager_times, native_times = [], []
            for _ in range(args.rounds):  # A B A B ...
                eager_times.append(median_us(hot.eager, op_input, calls))
                native_times.append(median_us(NATIVE[hot], op_input, calls))
            a, b = statistics.median(eager_times), statistics.median(native_times)
            print(f"{name:>18} {op:>13} {a:>9.1f} {b:>10.1f} {a / b:>7.1f}x")


if __name__ == "__main__":
    main()
