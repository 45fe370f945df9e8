"""Online latency under Poisson arrivals, both scheduling policies side by side.

    python benchmarks/arrivals.py [--model cpu-small|demo] [--requests 48] [--rate 8]

Requests arrive at --rate per second (exponential gaps, seed 0) with prompts and
outputs uniform in [--min-len, --max-len]; the driver adds each when its time has come,
between steps, as a server would, and steps the engine. Per policy it reports output
throughput, time to first token (TTFT) and inter-token latency (ITL: the gap between a
request's consecutive tokens) at p50 / p99 / max. The policies run alternately, each on
its own engine, the same arrivals through each.
"""

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.demo import demo_checkpoint, write_weightless_checkpoint

CPU_SMALL = {  # bench.py's cpu-small shape
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 768,
    "max_position_embeddings": 4096,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "vocab_size": 4096,
}


def workload(args) -> list[tuple[float, list[int], int]]:
    """(arrival time s, prompt, output length) per request."""
    rng = random.Random(0)
    t, requests = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        prompt = [rng.randrange(10, 500) for _ in range(rng.randint(args.min_len, args.max_len))]
        requests.append((t, prompt, rng.randint(args.min_len, args.max_len)))
    return requests


def run(llm: LLM, requests) -> dict[str, float]:
    """Drive the arrivals; token times are taken when a step returns."""
    pending = list(requests)
    arrival, token_times, seq_of = {}, {}, {}
    start = time.perf_counter()
    while pending or not llm.is_finished():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            t, prompt, n = pending.pop(0)
            sid = llm.add_request(
                prompt, SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True)
            )
            arrival[sid], token_times[sid] = t, []
            seq_of[sid] = next(s for s in llm.scheduler.waiting if s.seq_id == sid)
        if llm.is_finished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        llm.step()
        now = time.perf_counter() - start
        for sid, seq in seq_of.items():
            while len(token_times[sid]) < seq.num_completion_tokens:
                token_times[sid].append(now)
    elapsed = time.perf_counter() - start
    ttft = [times[0] - arrival[sid] for sid, times in token_times.items()]
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    tokens = sum(len(times) for times in token_times.values())
    return {
        "tok/s": tokens / elapsed,
        "ttft p50": pct(ttft, 50),
        "ttft p99": pct(ttft, 99),
        "itl p50": pct(itl, 50),
        "itl p99": pct(itl, 99),
        "itl max": 1e3 * max(itl),
    }


def pct(values: list[float], p: float) -> float:
    """The p-th percentile in milliseconds."""
    ordered = sorted(values)
    return 1e3 * ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("cpu-small", "demo"), default="cpu-small")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=8.0, help="arrivals per second")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    requests = workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "demo":
            path, extra = demo_checkpoint(), {}
        else:
            path, extra = (
                write_weightless_checkpoint(Path(tmp) / "m", CPU_SMALL),
                {"load_format": "dummy"},
            )
        print(
            f"{args.model}, {args.requests} requests at {args.rate}/s, lengths "
            f"{args.min_len}-{args.max_len}, max_num_batched_tokens "
            f"{args.max_num_batched_tokens}, {args.threads} thread(s), load "
            f"{os.getloadavg()[0]:.1f}"
        )
        print(
            f"{'policy':>14} "
            + " ".join(
                f"{k:>9}"
                for k in ("tok/s", "ttft p50", "ttft p99", "itl p50", "itl p99", "itl max")
            )
        )
        for policy in ("mixed", "prefill_first", "mixed", "prefill_first"):
            with LLM(
                str(path),
                device="cpu",
                kvcache_block_size=16,
                cpu_kvcache_space_gib=1.0,
                max_num_batched_tokens=args.max_num_batched_tokens,
                scheduling_policy=policy,
                cpu_threads=args.threads,
                **extra,
            ) as llm:
                r = run(llm, requests)
            print(f"{policy:>14} " + " ".join(f"{v:>9.1f}" for v in r.values()))


if __name__ == "__main__":
    main()
