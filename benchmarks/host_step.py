"""Host work per decode step: everything LLMEngine.step() does besides the model's own
forward (scheduling, input tensors, sampling metadata, sampling, postprocess).

    python benchmarks/host_step.py [--batch 64 256 512] [--model demo|tiny] [--threads 1]

`tiny` is a one-layer model 32 wide, whose compute is negligible; `demo` is the demo
checkpoint (example.py's). Each request has a prompt of --context tokens; once all are
decoding, --steps decode steps are timed. The model's forward and LM head are wrapped
with timers, so

    host = step - forward       (median ms over the timed steps)
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.models.demo import build_tiny_qwen3, demo_checkpoint


def timed(fn, totals: list[float]):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[0] += time.perf_counter() - start
    return wrapper


def measure(llm: LLM, batch: int, context: int, steps: int) -> tuple[float, float]:
    """(median step ms, median host ms) over `steps` decode steps of `batch` sequences."""
    model = llm.model_runner.model
    forward = [0.0]
    model.forward = timed(model.forward, forward)
    model.compute_logits = timed(model.compute_logits, forward)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.6, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        llm.add_request(torch.randint(0, 200, (context,), generator=g).tolist(), params)
    while True:  # prefill everything first
        out = llm.step()
        if out.num_decode_tokens == batch and not out.num_prefill_tokens:
            break
    step_ms, host_ms = [], []
    for _ in range(steps):
        forward[0] = 0.0
        start = time.perf_counter()
        out = llm.step()
        elapsed = time.perf_counter() - start
        assert out.num_decode_tokens == batch and not out.num_prefill_tokens
        step_ms.append(elapsed * 1e3)
        host_ms.append((elapsed - forward[0]) * 1e3)
    while not llm.is_finished():
        llm.step()
    del model.forward, model.compute_logits
    return statistics.median(step_ms), statistics.median(host_ms)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--model", choices=("tiny", "demo"), default="tiny")
    p.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            path = build_tiny_qwen3(Path(tmp) / "tiny", hidden_size=32, num_layers=1, num_heads=2,
                                    num_kv_heads=1, head_dim=16, intermediate_size=32)
        else:
            path = demo_checkpoint()
        with LLM(str(path), device="cpu", max_num_seqs=max(args.batch), kvcache_block_size=16,
                 max_model_len=args.context + args.steps + 64) as llm:
            print(f"{args.model} model, {args.threads} thread(s), context {args.context}; "
                  f"median ms per decode step")
            print(f"{'batch':>5} {'step':>8} {'host':>8}")
            for batch in args.batch:
                step, host = measure(llm, batch, args.context, args.steps)
                print(f"{batch:>5} {step:>8.3f} {host:>8.3f}")


if __name__ == "__main__":
    main()
