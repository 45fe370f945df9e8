"""Time the int8 weight-only linear (kernels/cpu_int8.py) against the float32 ones a CPU runner
has today: F.linear (MKL) and oneDNN's GEMM on a prepacked weight (layers/linear.py), called
in turn (A B C A B C ...) within each measurement, medians over the rounds.

    python benchmarks/cpu_int8.py [--threads 1 2] [--rows 1 4 16 64 256] [--dtype float32]
    python benchmarks/cpu_int8.py --cold        # M = 1 with the weights read from DRAM
    python benchmarks/cpu_int8.py --crossover   # where the kernel stops paying for prefill
    python benchmarks/cpu_int8.py --best        # fastest calls: 2 threads on a busy machine
    python benchmarks/cpu_int8.py --flags=-mno-avx512vnni  # the float32 tiles on a VNNI CPU
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/cpu_int8.py --flags=-mno-avx512f  # all three as on an AVX2 CPU

Weights: every linear of Qwen3-0.6B (qkv, o, gate_up, down, the LM head) and of cpu-small.
The default table reads the same weight again and again, so a layer of up to ~100 MB stays in
this CPU's L3: right for the GEMM-bound rows, flattering at M = 1, where a decode step reads
every layer once from DRAM. --cold rotates each candidate over copies of the weight totalling
--cold-mb MB. --crossover adds dequantize + F.linear, what a prefill chunk may run instead
(a layer's int8 weight widened to float32 once, then MKL's GEMM), over more rows.
The machine may be shared: the load average is printed beside each shape.
"""

import argparse
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from nanovllm.kernels import cpu_int8
from nanovllm.platforms.cpu.host import keep_freed_host_memory

SHAPES = {  # [out_features, in_features]
    "0.6b qkv": (4096, 1024),  # q 16 x 128 + k, v 8 x 128 each
    "0.6b o": (1024, 2048),
    "0.6b gate_up": (6144, 1024),
    "0.6b down": (1024, 3072),
    "0.6b lm_head": (151936, 1024),
    "small qkv": (512, 256),  # q 4 x 64 + k, v 2 x 64 each
    "small o": (256, 256),
    "small gate_up": (1536, 256),
    "small down": (256, 768),
    "small lm_head": (4096, 256),
}
CROSSOVER_ROWS = (64, 128, 256, 512, 1024, 2048)
BUDGET_S = 1.5  # a cell's timing, about


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def times_us(candidates: list, rounds: int, statistic) -> list[float]:
    """Each candidate called once a round, in turn; `statistic` (median, or min: the call that
    other work did not preempt) of each one's times."""
    times = [[] for _ in candidates]
    for _ in range(rounds):
        for i, fn in enumerate(candidates):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return [statistic(t) * 1e6 for t in times]


def rounds_for(candidates: list) -> int:
    start = time.perf_counter()
    for fn in candidates:  # also the warm-up
        fn()
    return max(3, min(60, int(BUDGET_S / (time.perf_counter() - start))))


class Layer:
    """A weight as the three candidates hold it."""

    def __init__(self, n: int, k: int, dtype: torch.dtype, seed: int = 0):
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
        self.qweight, self.scale = cpu_int8.quantize(weight)
        self.packed = cpu_int8.pack(self.qweight)
        self.weight = cpu_int8.dequantize(self.qweight, self.scale).to(dtype)  # same numbers
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
        self.n = n

    def candidates(self, library, x: torch.Tensor) -> list:
        return [
            partial(F.linear, x, self.weight),
            partial(onednn_linear, x, self.onednn),
            partial(cpu_int8.linear, library, x, self.packed, self.scale, self.n),
        ]


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def dequantized_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor):
    return F.linear(x, cpu_int8.dequantize(qweight, scale).to(x.dtype))


def table(library, threads: list[int], rows: list[int], dtype: torch.dtype, statistic) -> None:
    print(
        f"{'weight':>14} {'thr':>3} {'M':>4} {'F.linear us':>12} {'oneDNN us':>10} "
        f"{'int8 us':>9} {'F/int8':>7} {'oneDNN/int8':>11} {'int8 GB/s':>9}"
    )
    for name, (n, k) in SHAPES.items():
        layer = Layer(n, k, dtype)
        for t in threads:
            torch.set_num_threads(t)
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                candidates = layer.candidates(library, x)
                mkl, onednn, int8 = times_us(candidates, rounds_for(candidates), statistic)
                gbs = f"{n * k / int8 / 1e3:>9.1f}" if m == 1 else ""
                print(
                    f"{name:>14} {t:>3} {m:>4} {mkl:>12.1f} {onednn:>10.1f} {int8:>9.1f} "
                    f"{mkl / int8:>6.2f}x {onednn / int8:>10.2f}x {gbs}"
                )
        print(f"{'':>14} {load()}", flush=True)


def cold(library, threads: list[int], dtype: torch.dtype, total_mb: int, statistic) -> None:
    """M = 1, each call on the next copy of the weight: the bytes come from DRAM."""
    print(f"M = 1 from DRAM: each candidate rotates over {total_mb} MB of copies of the weight")
    print(
        f"{'weight':>14} {'thr':>3} {'F.linear us':>12} {'oneDNN us':>10} {'int8 us':>9} "
        f"{'F/int8':>7} {'oneDNN/int8':>11} {'F GB/s':>7} {'int8 GB/s':>9}"
    )
    for name, (n, k) in SHAPES.items():
        if not name.startswith("0.6b") or name.endswith("lm_head"):
            continue  # cpu-small fits in L3 whole; the LM head is 600 MB in float32 alone
        layer = Layer(n, k, dtype)
        weights = [layer.weight.clone() for _ in range(max(2, total_mb * 2**20 // (4 * n * k)))]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        packed = [layer.packed.clone() for _ in range(max(2, total_mb * 2**20 // (n * k)))]
        x = torch.randn(1, k).to(dtype)
        candidates = [
            [partial(F.linear, x, w) for w in weights],
            [partial(onednn_linear, x, w) for w in onednn],
            [partial(cpu_int8.linear, library, x, w, layer.scale, n) for w in packed],
        ]
        for t in threads:
            torch.set_num_threads(t)
            times = [[], [], []]
            for _ in range(5):
                for i, copies in enumerate(candidates):  # one candidate over its copies, the next
                    for fn in copies:
                        start = time.perf_counter()
                        fn()
                        times[i].append(time.perf_counter() - start)
            mkl, onednn_us, int8 = (statistic(t) * 1e6 for t in times)
            print(
                f"{name:>14} {t:>3} {mkl:>12.1f} {onednn_us:>10.1f} {int8:>9.1f} "
                f"{mkl / int8:>6.2f}x {onednn_us / int8:>10.2f}x {n * k * 4 / mkl / 1e3:>7.1f} "
                f"{n * k / int8 / 1e3:>9.1f}"
            )
        del weights, onednn, packed, candidates
        print(f"{'':>14} {load()}", flush=True)


def crossover(library, threads: list[int], dtype: torch.dtype, statistic) -> None:
    """The int8 kernel against a prefill's alternative: the layer dequantized, then F.linear."""
    print(
        f"{'weight':>14} {'thr':>3} {'M':>5} {'int8 us':>10} {'dequant+F us':>13} "
        f"{'F.linear us':>12} {'(dequant+F)/int8':>16}"
    )
    for name, (n, k) in SHAPES.items():
        if name.endswith("lm_head"):
            continue  # a prefill computes the LM head of each sequence's last token only
        layer = Layer(n, k, dtype)
        for t in threads:
            torch.set_num_threads(t)
            for m in CROSSOVER_ROWS:
                x = torch.randn(m, k).to(dtype)
                candidates = [
                    partial(cpu_int8.linear, library, x, layer.packed, layer.scale, n),
                    partial(dequantized_linear, x, layer.qweight, layer.scale),
                    partial(F.linear, x, layer.weight),
                ]
                int8, dequant, mkl = times_us(candidates, rounds_for(candidates), statistic)
                print(
                    f"{name:>14} {t:>3} {m:>5} {int8:>10.1f} {dequant:>13.1f} {mkl:>12.1f} "
                    f"{dequant / int8:>15.2f}x"
                )
        print(f"{'':>14} {load()}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--cold", action="store_true", help="M = 1 with the weights from DRAM")
    p.add_argument("--cold-mb", type=int, default=512)
    p.add_argument("--crossover", action="store_true", help="against dequantize + F.linear")
    p.add_argument("--flags", nargs="*", default=[], help="extra build flags: -mno-avx512f")
    p.add_argument(
        "--best", action="store_true", help="the fastest call, not the median (a busy machine)"
    )
    args = p.parse_args()
    statistic = min if args.best else statistics.median
    keep_freed_host_memory()
    library = cpu_int8.load(tuple(args.flags))
    assert library is not None, "the int8 kernel did not build"
    dtype = getattr(torch, args.dtype)
    amx = library.nanovllm_int8_amx_rows(dtype == torch.bfloat16)
    vnni = library.nanovllm_int8_vnni_inputs()
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs, int8 kernel: vectors of "
        f"{library.nanovllm_int8_vector_width()} floats, "
        f"{f'x in fixed point (VNNI) from K = {vnni}' if vnni else 'no VNNI'}, "
        f"{f'AMX from {amx} rows' if amx else 'no AMX'}; x {args.dtype}, "
        f"{'best' if args.best else 'median'} of the rounds, {load()}"
    )
    with torch.inference_mode():
        if args.cold:
            cold(library, args.threads, dtype, args.cold_mb, statistic)
        elif args.crossover:
            crossover(library, args.threads, dtype, statistic)
        else:
            table(library, args.threads, args.rows, dtype, statistic)


if __name__ == "__main__":
    main()
