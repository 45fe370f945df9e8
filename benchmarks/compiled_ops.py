"""Eager vs torch.compile'd vs Triton hot ops (nanovllm/compilation.py, kernels/fused_ops.py) on
Qwen3-0.6B's shapes, per call, on the CPU or a CUDA GPU:

    python benchmarks/compiled_ops.py [--device cpu|cuda] [--dtype bfloat16] \
        [--tokens 1 64 256 2048] [--json PATH]

Prints each op's time eager, compiled and (on CUDA, where the op has one) as its Triton kernel
at each token count, the speed-ups over eager, and the one-off compile time; then what the ops
cost a forward of the whole model (each op's calls a forward times its time), and which
implementation was fastest at each token count. Each op is compiled with dynamic shapes, as the
engine's become once they have seen two sizes (the decode graphs capture dozens): once for 1
token, which dynamo specializes, once for the rest. On CUDA a call's time is its GPU time as a
decode graph replays it: 20 calls captured in one CUDA graph, the best of 10 replays (the host's
dispatch and dynamo's guards are out of it, as they are out of a graph's replay); on a CPU,
wall time. This is the measurement behind the platforms' choices (compilation.py; on CUDA,
TRITON_HOT_OPS in platforms/cuda).
"""

import argparse
import json
import time
from collections.abc import Callable

import torch

from nanovllm.compilation import HotOp
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.layernorm import add_rms_norm, rms_norm
from nanovllm.layers.rotary_embedding import apply_rotary_emb, get_rope
from nanovllm.sampling.sampler import softmax_race

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 1024, 3072, 16, 8, 128, 151936
LAYERS = 28
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Each op's calls in one forward of Qwen3-0.6B: the first layer's input norm has no residual to
# add, the other 55 norms and the final one do; the sampler's draw once a step.
CALLS_PER_STEP = {
    "rms_norm": 1,
    "add_rms_norm": 2 * LAYERS,
    "q_norm": LAYERS,
    "k_norm": LAYERS,
    "silu_and_mul": LAYERS,
    "rotary": LAYERS,
    "softmax_race": 1,
}
IMPLEMENTATIONS = ("eager", "compiled", "triton")


def op_inputs(tokens: int, dtype: torch.dtype, device: str) -> dict[str, tuple[HotOp, tuple]]:
    """Each op with arguments shaped as in one Qwen3-0.6B layer (the sampler: one row per
    token, as in a decode batch)."""

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, dtype=dt, device=device)

    weight, eps = randn(HIDDEN), 1e-6
    cache = get_rope(HEAD_DIM, 4096, {"rope_theta": 1e6}).cos_sin_cache.to(device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    return {
        "rms_norm": (rms_norm, (randn(tokens, HIDDEN), weight, eps)),
        "add_rms_norm": (add_rms_norm, (randn(tokens, HIDDEN), randn(tokens, HIDDEN), weight, eps)),
        "q_norm": (rms_norm, (randn(tokens, HEADS, HEAD_DIM), randn(HEAD_DIM), eps)),
        "k_norm": (rms_norm, (randn(tokens, KV_HEADS, HEAD_DIM), randn(HEAD_DIM), eps)),
        "silu_and_mul": (silu_and_mul, (randn(tokens, 2 * INTERMEDIATE),)),
        "rotary": (
            apply_rotary_emb,
            (positions, randn(tokens, HEADS, HEAD_DIM), randn(tokens, KV_HEADS, HEAD_DIM), cache),
        ),
        "softmax_race": (softmax_race, (randn(min(tokens, 512), VOCAB, dt=torch.float32),)),
    }


def time_call(fn, args, device: str) -> float:
    """Seconds per call: on CUDA the GPU's, replayed from a graph; else the host's."""
    return graph_time(fn, args) if device == "cuda" else wall_time(fn, args)


def graph_time(fn, args, calls: int = 20, replays: int = 10) -> float:
    """`calls` calls captured in one CUDA graph (after two eager ones: compile, allocator);
    the best of `replays` replays, per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args), fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    best = float("inf")
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    graph.reset()
    return best


def wall_time(fn, args, min_time_s: float = 0.2) -> float:
    """The fastest of batches of 10 calls lasting >= min_time_s in all (the least disturbed
    by other load on the machine)."""
    fn(*args)
    samples, elapsed = [], 0.0
    while elapsed < min_time_s or len(samples) < 5:
        start = time.perf_counter()
        for _ in range(10):
            fn(*args)
        samples.append((time.perf_counter() - start) / 10)
        elapsed += samples[-1] * 10
    return min(samples)


def triton_kernel(op: HotOp, device: str) -> Callable | None:
    """The op's Triton kernel (kernels/fused_ops.py), on CUDA where it has one."""
    from nanovllm.platforms.cuda import FUSED_OPS

    if device != "cuda" or op.name not in FUSED_OPS:
        return None
    from nanovllm.kernels import fused_ops

    return getattr(fused_ops, op.name)


def measure(name: str, op: HotOp, args: tuple, device: str, compiled: dict) -> dict:
    """One op at one size: microseconds per call of each implementation it has, and how long
    torch.compile took (0 when it compiled nothing new)."""
    start = time.perf_counter()
    fn = compiled.setdefault(name, torch.compile(op.eager, dynamic=True))
    fn(*args)  # compiles (or recompiles for a new shape)
    row = {"compile_s": time.perf_counter() - start}
    kernel = triton_kernel(op, device)
    for impl, f in zip(IMPLEMENTATIONS, (op.eager, fn, kernel)):
        row[f"{impl}_us"] = time_call(f, args, device) * 1e6 if f is not None else None
    return row


def format_row(r: dict) -> str:
    def us(impl: str) -> str:
        return f"{r[f'{impl}_us']:.1f}" if r[f"{impl}_us"] is not None else "-"

    def speedup(impl: str) -> str:
        t = r[f"{impl}_us"]
        return f"{r['eager_us'] / t:.2f}x" if t is not None else "-"

    return (
        f"{r['op']:<14} {r['tokens']:>6} {us('eager'):>9} {us('compiled'):>9} {us('triton'):>9} "
        f"{speedup('compiled'):>10} {speedup('triton'):>10} {r['compile_s']:>9.1f}"
    )


def per_step(rows: list[dict]) -> dict[int, dict[str, float]]:
    """tokens -> implementation -> microseconds the ops cost a forward of the whole model (an op
    without a Triton kernel counts its compiled time in the Triton column, as the platform
    would run it; no Triton column where no op has a kernel, as on a CPU)."""
    impls = [i for i in IMPLEMENTATIONS if any(r[f"{i}_us"] is not None for r in rows)]
    steps: dict[int, dict[str, float]] = {}
    for r in rows:
        step = steps.setdefault(r["tokens"], dict.fromkeys(impls, 0.0))
        for impl in impls:
            t = r[f"{impl}_us"] if r[f"{impl}_us"] is not None else r["compiled_us"]
            step[impl] += CALLS_PER_STEP[r["op"]] * t
    return steps


def fastest(rows: list[dict]) -> dict[str, list[str]]:
    """op -> the fastest implementation at each token count, in order."""
    best: dict[str, list[str]] = {}
    for r in rows:
        times = {impl: r[f"{impl}_us"] for impl in IMPLEMENTATIONS if r[f"{impl}_us"] is not None}
        best.setdefault(r["op"], []).append(min(times, key=times.get))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 2048])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", help="write the rows, the per-step sums and the fastest here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    compiled: dict[str, object] = {}
    timer = "GPU time, replayed from a CUDA graph" if args.device == "cuda" else "wall time"
    print(
        f"{args.device} {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads; us per call ({timer})"
    )
    print(
        f"{'op':<14} {'tokens':>6} {'eager':>9} {'compiled':>9} {'triton':>9} "
        f"{'compiled x':>10} {'triton x':>10} {'compile s':>9}"
    )
    rows = []
    with torch.inference_mode():
        for tokens in args.tokens:
            for name, (op, op_args) in op_inputs(tokens, dtype, args.device).items():
                rows.append(
                    {
                        "op": name,
                        "tokens": tokens,
                        **measure(name, op, op_args, args.device, compiled),
                    }
                )
                print(format_row(rows[-1]), flush=True)  # kept even if the run is stopped later
    steps, best = per_step(rows), fastest(rows)
    print("\nper forward of Qwen3-0.6B (each op's calls a forward x its time), us")
    for tokens, step in steps.items():
        print(f"{tokens:>6} tokens: " + ", ".join(f"{impl} {t:,.0f}" for impl, t in step.items()))
    print(
        "fastest at "
        + "/".join(map(str, args.tokens))
        + " tokens: "
        + "; ".join(f"{op} {'/'.join(impls)}" for op, impls in best.items())
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "per_step": steps, "fastest": best}, f)


if __name__ == "__main__":
    main()
