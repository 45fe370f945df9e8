"""Host work per decode step: everything LLMEngine.step() does besides the model's own
forward (scheduling, input tensors, sampling metadata, sampling, postprocess).

    python benchmarks/host_step.py [--batch 64 256 512] [--model demo|tiny] [--threads 1]

`tiny` is a one-layer model 32 wide, whose compute is negligible; `demo` is the demo
checkpoint (example.py's). Each request has a prompt of --context tokens; once all are
decoding, --steps decode steps are timed. The model's forward and LM head, and the platform's
fast decode (a CPU's native step, CUDA graphs: the logits of a step), are wrapped with timers
(a call inside another counted once), so

    host = step - forward       (median ms over the timed steps)

and so are the parts: schedule (Scheduler.schedule), inputs (the step's tensors),
sampling (the sampling metadata), sampler (the sampler itself: device work on a GPU)
and post (Scheduler.postprocess).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import nanovllm.runner.model_runner as model_runner
from nanovllm import LLM, SamplingParams
from nanovllm.demo import build_tiny_qwen3, demo_checkpoint

PARTS = ("schedule", "inputs", "sampling", "sampler", "post")


def timed(fn, totals: list[float]):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[0] += time.perf_counter() - start

    return wrapper


def timed_outermost(fns: list, totals: list[float]) -> list:
    """Timers around `fns` sharing one total: a call made inside another's is not added again
    (CUDA graphs' run calls the LM head)."""
    depth = [0]

    def wrap(fn):
        def wrapper(*args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    totals[0] += time.perf_counter() - start

        return wrapper

    return [wrap(fn) for fn in fns]


def wrap_parts(llm: LLM) -> dict[str, list[float]]:
    """Timers around each part of a step (instance attributes and module globals)."""
    totals = {name: [0.0] for name in PARTS}
    llm.scheduler.schedule = timed(llm.scheduler.schedule, totals["schedule"])
    llm.scheduler.postprocess = timed(llm.scheduler.postprocess, totals["post"])
    sampler = llm.model_runner.sampler
    sampler.forward = timed(sampler.forward, totals["sampler"])
    model_runner.prepare_inputs = timed(model_runner.prepare_inputs, totals["inputs"])
    metadata = llm.model_runner.sampling_metadata
    metadata.build = timed(metadata.build, totals["sampling"])
    return totals


def measure(llm: LLM, batch: int, context: int, steps: int) -> dict[str, float]:
    """Median ms of the step, its host work and each part over `steps` decode steps."""
    model, fast = llm.model_runner.model, llm.model_runner.fast_decode
    forward = [0.0]
    if fast is None:
        model.forward, model.compute_logits = timed_outermost(
            [model.forward, model.compute_logits], forward
        )
    else:
        model.forward, model.compute_logits, fast.run = timed_outermost(
            [model.forward, model.compute_logits, fast.run], forward
        )
    parts = wrap_parts(llm)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.6, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        llm.add_request(torch.randint(0, 200, (context,), generator=g).tolist(), params)
    while True:  # prefill everything first
        out = llm.step()
        if out.num_decode_tokens == batch and not out.num_prefill_tokens:
            break
    samples: dict[str, list[float]] = {name: [] for name in ("step", "host", *PARTS)}
    for _ in range(steps):
        forward[0] = 0.0
        for total in parts.values():
            total[0] = 0.0
        start = time.perf_counter()
        out = llm.step()
        elapsed = time.perf_counter() - start
        assert out.num_decode_tokens == batch and not out.num_prefill_tokens
        samples["step"].append(elapsed * 1e3)
        samples["host"].append((elapsed - forward[0]) * 1e3)
        for name, total in parts.items():
            samples[name].append(total[0] * 1e3)
    while not llm.is_finished():
        llm.step()
    return {name: statistics.median(values) for name, values in samples.items()}


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
            path = build_tiny_qwen3(
                Path(tmp) / "tiny",
                hidden_size=32,
                num_layers=1,
                num_heads=2,
                num_kv_heads=1,
                head_dim=16,
                intermediate_size=32,
            )
        else:
            path = demo_checkpoint()
        print(
            f"{args.model} model, {args.threads} thread(s), context {args.context}; "
            f"median ms per decode step"
        )
        print(f"{'batch':>5} " + " ".join(f"{name:>8}" for name in ("step", "host", *PARTS)))
        for batch in args.batch:  # a fresh engine each: the wrappers are its own
            with LLM(
                str(path),
                device="cpu",
                max_num_seqs=batch,
                kvcache_block_size=16,
                max_model_len=args.context + args.steps + 64,
                cpu_threads=args.threads,
            ) as llm:
                r = measure(llm, batch, args.context, args.steps)
            print(f"{batch:>5} " + " ".join(f"{r[n]:>8.3f}" for n in ("step", "host", *PARTS)))


if __name__ == "__main__":
    main()
