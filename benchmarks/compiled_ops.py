"""Eager vs torch.compile'd hot ops (nanovllm/compilation.py) on Qwen3-0.6B's shapes, per call,
on the CPU or a CUDA GPU:

    python benchmarks/compiled_ops.py [--device cpu|cuda] [--dtype bfloat16] \
        [--tokens 1 64 256 2048]

Prints each op's time eager and compiled at each token count, the speed-up, and the one-off
compile time. Each op is compiled with dynamic shapes, as the engine's become once they have
seen two sizes (the decode graphs capture dozens): once for 1 token, which dynamo specializes,
once for the rest. On CUDA a call's time is its GPU time
as a decode graph replays it: 20 calls captured in one CUDA graph, the best of 10 replays (the
host's dispatch and dynamo's guards are out of it, as they are out of a graph's replay); on a
CPU, wall time. This is the measurement behind the platforms' choices (compilation.py).
"""

import argparse
import time

import torch

from nanovllm.compilation import HotOp
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.layernorm import add_rms_norm, rms_norm
from nanovllm.layers.rotary_embedding import apply_rotary_emb, get_rope
from nanovllm.sampling.sampler import softmax_race

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 1024, 3072, 16, 8, 128, 151936
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 2048])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    compiled: dict[str, object] = {}
    print(
        f"{args.device} {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'op':<14} {'tokens':>6} {'eager us':>10} {'compiled us':>12} {'speed-up':>9} "
        f"{'compile s':>10}"
    )
    with torch.inference_mode():
        for tokens in args.tokens:
            for name, (op, op_args) in op_inputs(tokens, dtype, args.device).items():
                start = time.perf_counter()
                fn = compiled.setdefault(name, torch.compile(op.eager, dynamic=True))
                fn(*op_args)  # compiles (or recompiles for a new shape)
                compile_s = time.perf_counter() - start
                eager_s = time_call(op.eager, op_args, args.device)
                compiled_s = time_call(fn, op_args, args.device)
                print(
                    f"{name:<14} {tokens:>6} {eager_s * 1e6:>10.1f} {compiled_s * 1e6:>12.1f} "
                    f"{eager_s / compiled_s:>8.2f}x {compile_s:>10.1f}",
                    flush=True,  # a row is kept even if the stage is stopped after it
                )


if __name__ == "__main__":
    main()
