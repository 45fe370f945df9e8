"""Where a decode step's time goes on CUDA: host work vs GPU work.

    python benchmarks/decode_step.py [--enforce-eager] [--batch 1 64 256] [--context 512]

Qwen3-0.6B's shape with random weights (load_format="dummy"), bfloat16, temperature 0.6.
For each batch size, `batch` requests of `context` prompt tokens are prefilled, then
decode steps are driven as LLMEngine.step() drives them, timing each part:

    schedule   the scheduler picks the batch                         (host)
    launch     inputs built and copied, graph replayed or kernels     (host; the GPU
               launched, sampling queued: ModelRunner.execute_model    idles meanwhile)
    wait       .tolist() of the sampled ids: the GPU finishing        (the step's sync)
    post       the scheduler records the tokens                       (host)

and, on every other step, with the GPU kept busy (torch.cuda._sleep) while the step is
queued behind it:

    launch busy   the same launch with the GPU busy: equal to `launch` when nothing in it
                  waits for the GPU; a hidden host sync would add the GPU's backlog
    gpu           the step's device time alone (CUDA events around its work, which ran
                  back to back behind the sleep, with no host gap)

step = schedule + launch + wait + post; step - gpu is what host work costs per step.
"""

import argparse
import os
import statistics
import tempfile
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.demo import write_weightless_checkpoint

BUSY_MS = 20.0  # GPU work queued ahead of a "busy" step


def sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def decode_until_all_running(llm: LLM) -> None:
    """Step until every request has been prefilled (the next steps decode)."""
    while llm.scheduler.waiting or any(s.is_prefill for s in llm.scheduler.running):
        llm.step()


def time_steps(llm: LLM, steps: int, cycles_per_ms: float) -> dict[str, float]:
    """Median milliseconds of each part over `steps` idle and `steps` busy decode steps."""
    scheduler, runner = llm.scheduler, llm.model_runner
    parts: dict[str, list[float]] = {
        k: [] for k in ("schedule", "launch", "wait", "post", "launch busy", "gpu")
    }
    for i in range(2 * steps):
        busy = i % 2 == 1
        t0 = time.perf_counter()
        seqs = scheduler.schedule()
        assert not any(seq.is_prefill for seq in seqs)
        t1 = time.perf_counter()
        if busy:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(BUSY_MS * cycles_per_ms))
            start.record()
            t1 = time.perf_counter()
        sampled = runner.execute_model(seqs).token_ids
        t2 = time.perf_counter()
        if busy:
            end.record()
        token_ids = sampled.tolist()
        t3 = time.perf_counter()
        scheduler.postprocess(seqs, token_ids)
        t4 = time.perf_counter()
        if busy:
            parts["launch busy"].append((t2 - t1) * 1e3)
            parts["gpu"].append(start.elapsed_time(end))
        else:
            for name, ms in (
                ("schedule", t1 - t0),
                ("launch", t2 - t1),
                ("wait", t3 - t2),
                ("post", t4 - t3),
            ):
                parts[name].append(ms * 1e3)
    result = {name: statistics.median(values) for name, values in parts.items()}
    result["step"] = sum(result[k] for k in ("schedule", "launch", "wait", "post"))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no compile")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=20, help="idle and busy steps each")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_step.py needs a CUDA GPU")
    cycles_per_ms = sleep_cycles_per_ms()
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_weightless_checkpoint(os.path.join(tmp, "qwen3-0.6b"))
        with LLM(
            path,
            load_format="dummy",
            dtype="bfloat16",
            enforce_eager=args.enforce_eager,
            max_model_len=args.context + 4 * args.steps + 64,
        ) as llm:
            mode = "eager" if args.enforce_eager else "graphs"
            print(
                f"{torch.cuda.get_device_name()}, {mode}, context {args.context}; "
                f"median ms per decode step"
            )
            print(
                f"{'batch':>5} {'step':>7} {'gpu':>7} {'host':>7} {'schedule':>8} "
                f"{'launch':>7} {'wait':>7} {'post':>7} {'launch busy':>11}"
            )
            params = SamplingParams(temperature=0.6, max_tokens=4 * args.steps + 8, ignore_eos=True)
            for batch in args.batch:
                for _ in range(batch):  # token ids below 10000, as nano-vLLM's benchmark
                    prompt = torch.randint(0, 10000, (args.context,), generator=g).tolist()
                    llm.add_request(prompt, params)
                decode_until_all_running(llm)
                r = time_steps(llm, args.steps, cycles_per_ms)
                while not llm.is_finished():
                    llm.step()
                print(
                    f"{batch:>5} {r['step']:>7.2f} {r['gpu']:>7.2f} {r['step'] - r['gpu']:>7.2f} "
                    f"{r['schedule']:>8.2f} {r['launch']:>7.2f} {r['wait']:>7.2f} "
                    f"{r['post']:>7.2f} {r['launch busy']:>11.2f}"
                )


if __name__ == "__main__":
    main()
