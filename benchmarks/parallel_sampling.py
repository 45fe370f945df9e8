"""What SamplingParams(n=8) saves over 8 copies of the prompt: prompt tokens computed and
the time to the first completion token of all 8.

    python -m benchmarks.parallel_sampling [--preset cpu-small] [--prompt-len 1000 1024]
                                          [--n 8] [--block-size 256] [--repeats 3] [--threads N]

A model of bench.py's preset shape with random weights. Each run is one generate of a
fresh random prompt (no earlier run's prefix-cache hits), max_tokens=1, so the time is
prefill: either one request with n=8, or 8 requests of the same prompt with n=1, which
are admitted together and all computed (identical blocks computed in the same step are
not shared). The two kinds take turns; each reports its fastest run (the least disturbed
by other load). The prompt tokens counted are each step's num_prefill_tokens.
"""

import argparse
import tempfile
import time

import torch

from bench import PRESETS
from nanovllm import LLM, SamplingParams
from nanovllm.demo import write_weightless_checkpoint


def run(llm: LLM, prompt: list[int], n: int, copies: int) -> tuple[int, float]:
    """(prompt tokens computed, seconds) to finish `copies` requests of `prompt` with n each."""
    params = SamplingParams(n=n, temperature=1.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    for _ in range(copies):
        llm.add_request(prompt, params)
    computed = 0
    while not llm.is_finished():
        computed += llm.step().num_prefill_tokens
    return computed, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[1000, 1024])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0 = torch's default); 1 is steadier on a busy machine",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = PRESETS[args.preset].config
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as path:
        write_weightless_checkpoint(path, config)
        block = args.block_size
        llm = LLM(
            path,
            load_format="dummy",
            max_model_len=4096,
            kvcache_block_size=block,
            num_kvcache_blocks=2 * args.n * 4096 // block,
            cpu_threads=args.threads,
        )
        print(f"preset {args.preset}, block size {block}, torch threads {torch.get_num_threads()}")
        for length in args.prompt_len:
            best = {}
            for _ in range(args.repeats):
                for kind, n, copies in (("n", args.n, 1), ("copies", 1, args.n)):
                    prompt = torch.randint(0, config["vocab_size"], (length,), generator=g).tolist()
                    tokens, seconds = run(llm, prompt, n, copies)
                    best[kind] = min(
                        best.get(kind, (tokens, seconds)), (tokens, seconds), key=lambda r: r[1]
                    )
            (n_tokens, n_s), (c_tokens, c_s) = best["n"], best["copies"]
            print(
                f"prompt {length:5d}: n={args.n} {n_tokens:6d} tokens {n_s * 1e3:8.1f} ms | "
                f"{args.n} copies {c_tokens:6d} tokens {c_s * 1e3:8.1f} ms | tokens "
                f"{n_tokens / c_tokens:.3f}x, time {n_s / c_s:.3f}x"
            )
        llm.close()


if __name__ == "__main__":
    main()
