"""Time a CPU linear both ways, interleaved: F.linear (MKL's GEMM) against oneDNN's GEMM on
a prepacked weight (what a CPU runner uses up to layers.linear.PACKED_MAX_ROWS rows).

    python benchmarks/cpu_linear.py [--threads N] [--dtype float32|bfloat16]

Weights: cpu-small's MLP and Qwen3-0.6B's (gate+up, down) and its LM head; rows from a
decode batch of 1 to a prefill of 8192 tokens. Prints the CPU's load average: other work
skews both columns alike, since they alternate.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F

WEIGHTS = {
    "cpu-small gate_up": (1536, 256),
    "0.6b gate_up": (6144, 1024),
    "0.6b down": (1024, 3072),
    "0.6b lm_head": (151936, 1024),
}
ROWS = (1, 8, 32, 128, 512, 2048, 8192)


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"threads {args.threads}, {args.dtype}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'weight':>18} {'rows':>5} {'F.linear ms':>12} {'oneDNN ms':>10} {'speedup':>8}")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (out_features, in_features) in WEIGHTS.items():
            weight = torch.randn(out_features, in_features, generator=g).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            for rows in ROWS:
                if rows * out_features > 2**28:
                    continue  # the LM head computes only each sequence's last row
                x = torch.randn(rows, in_features, generator=g).to(dtype)
                repeats = max(3, min(50, 2**24 // (rows * out_features)))
                mkl = best_ms(lambda x=x, weight=weight: F.linear(x, weight), repeats)
                onednn = best_ms(
                    lambda x=x, packed=packed: torch.ops.mkldnn._linear_pointwise(
                        x, packed, None, "none", [], ""
                    ),
                    repeats,
                )
                print(f"{name:>18} {rows:>5} {mkl:>12.3f} {onednn:>10.3f} {mkl / onednn:>7.2f}x")


if __name__ == "__main__":
    main()
