"""Throughput of tensor_parallel_size=2 against 1 on this machine's CPU (gloo).

    python benchmarks/tp_overhead.py [--prompts 16 --prompt-len 64 --new-tokens 64 --repeats 3]

Runs the same greedy batch on the demo checkpoint (nanovllm/models/demo.py) at TP=1
and TP=2 and prints tokens/s (prompt + completion tokens over generate()'s wall time,
best of --repeats after a warm-up) and the ratio TP=2 / TP=1. On a small or shared
machine run it with OMP_NUM_THREADS=1: OpenMP threads of several processes spinning on
the same cores make the timings erratic (TP=1 included).
"""

import argparse
import random
from time import perf_counter

from nanovllm import LLM, SamplingParams
from nanovllm.demo import demo_checkpoint


def tokens_per_second(
    path: str, tp: int, prompts: list[list[int]], new_tokens: int, repeats: int
) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    total = sum(len(p) for p in prompts) + len(prompts) * new_tokens
    with LLM(
        path,
        tensor_parallel_size=tp,
        enforce_eager=True,
        num_kvcache_blocks=256,
        kvcache_block_size=16,
    ) as llm:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best = min(best, perf_counter() - start)
    return total / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    path = str(demo_checkpoint())
    speeds = {
        tp: tokens_per_second(path, tp, prompts, args.new_tokens, args.repeats) for tp in (1, 2)
    }
    for tp, speed in speeds.items():
        print(f"tensor_parallel_size={tp}: {speed:8.0f} tokens/s")
    print(f"TP=2 / TP=1 throughput: {speeds[2] / speeds[1]:.2f}")


if __name__ == "__main__":
    main()
