"""Time the group-quantized int4 linear (kernels/cpu_int4.py) against the int8 one
(kernels/cpu_int8.py) and the float32 ones a CPU runner has (F.linear, MKL's; oneDNN's GEMM on a
prepacked weight), called in turn (A B C D A B C D ...) within each measurement, medians over
the rounds.

    python benchmarks/cpu_int4.py [--threads 1 2] [--rows 1 2 4 16 128] [--group-size 128]
    python benchmarks/cpu_int4.py --cold        # the weights read from DRAM
    python benchmarks/cpu_int4.py --crossover   # where the kernel stops paying for prefill
    python benchmarks/cpu_int4.py --forms [--cold]  # GGUF's forms: Q4_0's and Q4_K's, AFFINE's
    python benchmarks/cpu_int4.py --best        # fastest calls: on a busy machine
    python benchmarks/cpu_int4.py --engine [--rounds 3]  # whole engines: int8 and int4 in turn
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/cpu_int4.py --flags=-mno-avx512f  # as on an AVX2 CPU

Weights: every linear of Qwen3-0.6B (qkv, o, gate_up, down; the LM head with --lm-head), random, the
same numbers in every format (int8 and the float32 weight are the int4 one's dequantized values).
The default table reads the same weight again and again, so a layer stays in this CPU's L3: right
where the GEMM is compute-bound, flattering at 1-4 rows, where a decode step reads every layer once
from DRAM. --cold rotates each candidate over copies of its weight totalling --cold-mb MB.
--crossover adds what a prefill chunk may run instead: the layer dequantized
(Int4Weight.dequantize), then F.linear. --forms times the kernel's forms (cpu_int4.Form) on the same
shapes: AFFINE with groups of 32 (how GGUF's 4-bit types ran before forms of their own) and 256,
SYMMETRIC with 32 (Q4_0's), SUB_SCALED with 256 (Q4_K's), each from random 4-bit values and float16
scales as a file holds them. --engine runs the engine itself, Qwen3-0.6B's shape with random
weights, int8 and int4 (and float32 with --float) built side by side in this process and timed in
turn each round, as benchmarks/llamacpp.py times nanovllm: one request's prefill of --prompt tokens
and its decode of --gen, then --batch requests' decode steps after their prompts. The machine may be
shared: the load average is printed beside each figure.
"""

import argparse
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from nanovllm.kernels import cpu_int4, cpu_int8
from nanovllm.platforms.cpu.host import keep_freed_host_memory
from nanovllm.quantization.int4 import Int4Weight

SHAPES = {  # [out_features, in_features]
    "0.6b qkv": (4096, 1024),  # q 16 x 128 + k, v 8 x 128 each
    "0.6b o": (1024, 2048),
    "0.6b gate_up": (6144, 1024),
    "0.6b down": (1024, 3072),
}
LM_HEAD = ("0.6b lm_head", (151936, 1024))
CROSSOVER_ROWS = (128, 256, 512, 1024, 2048)
BUDGET_S = 1.5  # a cell's timing, about


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def times_us(candidates: list, rounds: int, statistic) -> list[float]:
    """Each candidate called once a round, in turn; `statistic` of each one's times."""
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
    return max(3, min(100, int(BUDGET_S / (time.perf_counter() - start))))


class Layer:
    """A weight as the candidates hold it: int4 panels, int8 panels, float32 (plain and
    oneDNN's blocked copy), all the int4 weight's values."""

    def __init__(self, n: int, k: int, group_size: int, libraries, seed: int = 0):
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
        self.q, self.scale, self.offset = cpu_int4.quantize(weight, group_size)
        self.packed = cpu_int4.pack(self.q, self.scale, self.offset, group_size)
        self.weight = cpu_int4.dequantize(self.q, self.scale, self.offset, group_size)
        qweight, self.scale8 = cpu_int8.quantize(self.weight)
        self.packed8 = cpu_int8.pack(qweight)
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
        self.n, self.group_size = n, group_size
        self.int4, self.int8 = libraries

    def f32(self, x):
        return F.linear(x, self.weight)

    def onednn_linear(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn, None, "none", [], "")

    def int8_linear(self, x, packed=None):
        packed = self.packed8 if packed is None else packed
        return cpu_int8.linear(self.int8, x, packed, self.scale8, self.n)

    def int4_linear(self, x, packed=None):
        packed = self.packed if packed is None else packed
        return cpu_int4.linear(self.int4, x, packed, self.n, self.group_size)


def table(libraries, shapes: dict, threads: list[int], rows: list[int], group_size, statistic):
    print(
        f"{'weight':>14} {'thr':>3} {'M':>4} {'F.linear us':>11} {'oneDNN us':>10} "
        f"{'int8 us':>9} {'int4 us':>9} {'int8/int4':>9} {'F/int4':>7} {'oneDNN/int4':>11} "
        f"{'int4 GB/s':>9}"
    )
    for name, (n, k) in shapes.items():
        layer = Layer(n, k, group_size, libraries)
        for t in threads:
            torch.set_num_threads(t)
            for m in rows:
                x = torch.randn(m, k)
                candidates = [
                    partial(layer.f32, x),
                    partial(layer.onednn_linear, x),
                    partial(layer.int8_linear, x),
                    partial(layer.int4_linear, x),
                ]
                f32, onednn, int8, int4 = times_us(candidates, rounds_for(candidates), statistic)
                gbs = f"{layer.packed.numel() / int4 / 1e3:>9.1f}" if m == 1 else ""
                print(
                    f"{name:>14} {t:>3} {m:>4} {f32:>11.1f} {onednn:>10.1f} {int8:>9.1f} "
                    f"{int4:>9.1f} {int8 / int4:>8.2f}x {f32 / int4:>6.2f}x "
                    f"{onednn / int4:>10.2f}x {gbs}"
                )
        print(f"{'':>14} {load()}", flush=True)


def cold(libraries, threads, rows, group_size, total_mb: int, statistic) -> None:
    """Each call on the next copy of the weight: the bytes come from DRAM."""
    print(f"from DRAM: each candidate rotates over {total_mb} MB of copies of its weight")
    print(
        f"{'weight':>14} {'thr':>3} {'M':>4} {'F.linear us':>11} {'int8 us':>9} {'int4 us':>9} "
        f"{'int8/int4':>9} {'F/int4':>7} {'int8 GB/s':>9} {'int4 GB/s':>9}"
    )
    for name, (n, k) in SHAPES.items():
        layer = Layer(n, k, group_size, libraries)

        def copies(t: torch.Tensor) -> list[torch.Tensor]:
            return [t.clone() for _ in range(max(2, total_mb * 2**20 // t.nbytes))]

        weights, packed8, packed4 = (
            copies(layer.weight),
            copies(layer.packed8),
            copies(layer.packed),
        )
        for t in threads:
            torch.set_num_threads(t)
            for m in rows:
                x = torch.randn(m, k)
                candidates = [
                    [partial(F.linear, x, w) for w in weights],
                    [partial(layer.int8_linear, x, p) for p in packed8],
                    [partial(layer.int4_linear, x, p) for p in packed4],
                ]
                times = [[], [], []]
                for _ in range(5):
                    for i, calls in enumerate(candidates):  # one over its copies, the next
                        for fn in calls:
                            start = time.perf_counter()
                            fn()
                            times[i].append(time.perf_counter() - start)
                f32, int8, int4 = (statistic(t) * 1e6 for t in times)
                print(
                    f"{name:>14} {t:>3} {m:>4} {f32:>11.1f} {int8:>9.1f} {int4:>9.1f} "
                    f"{int8 / int4:>8.2f}x {f32 / int4:>6.2f}x "
                    f"{layer.packed8.numel() / int8 / 1e3:>9.1f} "
                    f"{layer.packed.numel() / int4 / 1e3:>9.1f}"
                )
        del weights, packed8, packed4, candidates
        print(f"{'':>14} {load()}", flush=True)


FORMS = (  # (name, form, group size)
    ("AFFINE 32", cpu_int4.Form.AFFINE, 32),
    ("SYMMETRIC 32", cpu_int4.Form.SYMMETRIC, 32),
    ("SUB_SCALED 256", cpu_int4.Form.SUB_SCALED, 256),
    ("AFFINE 256", cpu_int4.Form.AFFINE, 256),
)


def form_weight(n: int, k: int, form: cpu_int4.Form, group_size: int, seed: int = 0):
    """Packed random 4-bit values in `form`, float16 scales and offsets (6-bit sub-scales for
    SUB_SCALED), as a GGUF file would give them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // group_size, generator=g) * 1e-3).half().float()
    offset, subs = -8 * scale, ()
    if form == cpu_int4.Form.SUB_SCALED:
        offset = -scale
        subs = tuple(
            torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8) for _ in "sm"
        )
    return cpu_int4.pack(q, scale, offset, group_size, form, *subs)


def each_copy(library, x, copies: list[torch.Tensor], n: int, form, group_size: int) -> None:
    for packed in copies:
        cpu_int4.linear(library, x, packed, n, group_size, None, form)


def forms(library, threads, rows, statistic, cold_mb: int | None) -> None:
    """Each form of the kernel on every layer's shape, called in turn; with `cold_mb`, each call
    on the next of that many MB of copies (the bytes from DRAM)."""
    print(f"{'weight':>14} {'thr':>3} {'M':>4} " + " ".join(f"{n + ' us':>17}" for n, *_ in FORMS))
    for name, (n, k) in SHAPES.items():
        copies = []
        for _, form, group_size in FORMS:
            packed = form_weight(n, k, form, group_size)
            count = max(2, cold_mb * 2**20 // packed.nbytes) if cold_mb else 1
            copies.append([packed] + [packed.clone() for _ in range(count - 1)])
        for t in threads:
            torch.set_num_threads(t)
            for m in rows:
                x = torch.randn(m, k)
                candidates = [
                    partial(each_copy, library, x, c, n, form, group_size)
                    for c, (_, form, group_size) in zip(copies, FORMS)
                ]
                times = times_us(candidates, rounds_for(candidates), statistic)
                per_call = [t_us / len(c) for t_us, c in zip(times, copies)]
                print(f"{name:>14} {t:>3} {m:>4} " + " ".join(f"{x:>17.1f}" for x in per_call))
        per_weight = (f"{n} {cpu_int4.bytes_per_weight(g, f):.4f}" for n, f, g in FORMS)
        print(f"{'':>14} {load()}; bytes a weight: {', '.join(per_weight)}", flush=True)


def dequantized_linear(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    return F.linear(x, weight.dequantize())


def crossover(libraries, threads, group_size, statistic) -> None:
    """The int4 kernel against a prefill's alternative: the layer dequantized, then F.linear."""
    print(
        f"{'weight':>14} {'thr':>3} {'M':>5} {'int4 us':>10} {'dequant+F us':>13} "
        f"{'F.linear us':>12} {'int8 us':>10} {'(dequant+F)/int4':>16}"
    )
    for name, (n, k) in SHAPES.items():
        layer = Layer(n, k, group_size, libraries)
        weight = Int4Weight(layer.q, layer.scale, layer.offset, group_size)
        for t in threads:
            torch.set_num_threads(t)
            for m in CROSSOVER_ROWS:
                x = torch.randn(m, k)
                candidates = [
                    partial(layer.int4_linear, x),
                    partial(dequantized_linear, x, weight),
                    partial(layer.f32, x),
                    partial(layer.int8_linear, x),
                ]
                int4, dequant, f32, int8 = times_us(candidates, rounds_for(candidates), statistic)
                print(
                    f"{name:>14} {t:>3} {m:>5} {int4:>10.1f} {dequant:>13.1f} {f32:>12.1f} "
                    f"{int8:>10.1f} {dequant / int4:>15.2f}x"
                )
        print(f"{'':>14} {load()}", flush=True)


def engine_runs(args) -> None:
    """Whole engines, one per weight format, in this process, each timed in turn a round."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.demo import QWEN3_0_6B_CONFIG, write_weightless_checkpoint

    params = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    path = write_weightless_checkpoint(tempfile.mkdtemp(prefix="qwen3-0.6b-"), QWEN3_0_6B_CONFIG)
    formats = ["int8", "int4"] + (["float32"] if args.float else [])
    llms = {
        name: LLM(
            str(path),
            device="cpu",
            dtype="float32",
            load_format="dummy",
            quantization=None if name == "float32" else name,
            cpu_threads=args.threads[0],
            max_model_len=args.prompt + args.gen + 16,
            cpu_kvcache_space_gib=1.0,
            enforce_eager=not args.decode_step,
        )
        for name in formats
    }

    def timed(llm, n: int) -> tuple[float, float, int]:
        for _ in range(n):
            llm.add_request(torch.randint(0, 500, (args.prompt,), generator=g).tolist(), params)
        prefill = decode = 0.0
        decoded = 0
        while not llm.is_finished():
            start = time.perf_counter()
            out = llm.step()
            elapsed = time.perf_counter() - start
            if out.num_prefill_tokens:
                prefill += elapsed
            else:
                decode += elapsed
                decoded += out.num_decode_tokens
        return prefill, decode, decoded

    figures = {name: [] for name in formats}
    for llm in llms.values():
        timed(llm, 1)  # warm-up
    for r in range(args.rounds):
        for name, llm in llms.items():
            prefill, decode, decoded = timed(llm, 1)
            row = [args.prompt / prefill, decoded / decode]
            if args.batch > 1:
                _, decode, decoded = timed(llm, args.batch)
                row.append(decoded / decode)
            figures[name].append(row)
            print(f"round {r}: {name:>7} " + " ".join(f"{x:8.1f}" for x in row) + f"  {load()}")
    columns = ["prefill tok/s", "decode tok/s"] + (
        [f"decode x{args.batch}"] if args.batch > 1 else []
    )
    print(f"{'format':>8} " + " ".join(f"{c:>14}" for c in columns) + "   (medians)")
    medians = {n: [statistics.median(col) for col in zip(*rows)] for n, rows in figures.items()}
    for name, row in medians.items():
        print(f"{name:>8} " + " ".join(f"{x:>14.1f}" for x in row))
    ratio = [a / b for a, b in zip(medians["int4"], medians["int8"])]
    print(f"{'int4/int8':>8} " + " ".join(f"{x:>13.2f}x" for x in ratio))
    for llm in llms.values():
        llm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 128])
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--lm-head", action="store_true", help="the LM head too (150 MB in float32)")
    p.add_argument("--cold", action="store_true", help="the weights from DRAM")
    p.add_argument("--cold-mb", type=int, default=256)
    p.add_argument("--crossover", action="store_true", help="against dequantize + F.linear")
    p.add_argument("--forms", action="store_true", help="the kernel's forms (GGUF's Q4_0, Q4_K)")
    p.add_argument("--flags", nargs="*", default=[], help="extra build flags: -mno-avx512f")
    p.add_argument("--engine", action="store_true", help="whole engines, int8 and int4 in turn")
    p.add_argument("--float", action="store_true", help="with --engine: float32 too")
    p.add_argument("--rounds", type=int, default=3, help="with --engine")
    p.add_argument("--prompt", type=int, default=128, help="with --engine")
    p.add_argument("--gen", type=int, default=128, help="with --engine")
    p.add_argument("--batch", type=int, default=16, help="with --engine: requests batched")
    p.add_argument(
        "--decode-step",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --engine: the native decode step (default: on)",
    )
    p.add_argument(
        "--best", action="store_true", help="the fastest call, not the median (a busy machine)"
    )
    args = p.parse_args()
    statistic = min if args.best else statistics.median
    keep_freed_host_memory()
    libraries = cpu_int4.load(tuple(args.flags)), cpu_int8.load(tuple(args.flags))
    assert None not in libraries, "a kernel did not build"
    dot = ("plain loops", "multiply-add pairs", "dot-product instructions (VNNI)")
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs, int4 kernel: vectors of "
        f"{libraries[0].nanovllm_int4_vector_width()} lanes, "
        f"{dot[libraries[0].nanovllm_int4_dot()]}; groups of {args.group_size}; x float32, "
        f"{'best' if args.best else 'median'} of the rounds, {load()}"
    )
    shapes = dict(SHAPES, **dict([LM_HEAD])) if args.lm_head else SHAPES
    if args.engine:
        return engine_runs(args)
    with torch.inference_mode():
        if args.forms:
            cold_mb = args.cold_mb if args.cold else None
            forms(libraries[0], args.threads, args.rows, statistic, cold_mb)
        elif args.cold:
            cold(libraries, args.threads, args.rows, args.group_size, args.cold_mb, statistic)
        elif args.crossover:
            crossover(libraries, args.threads, args.group_size, statistic)
        else:
            table(libraries, shapes, args.threads, args.rows, args.group_size, statistic)


if __name__ == "__main__":
    main()
