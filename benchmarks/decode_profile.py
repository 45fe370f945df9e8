"""Where a decode step's GPU time goes, kernel by kernel, against the step's memory floor (CUDA).

    python -m benchmarks.decode_profile [--batch 1 256] [--context 512] [--steps 5] [--json PATH]

Qwen3-0.6B's shape with random weights, bfloat16, CUDA graphs on, temperature 0.6 (the bench's
settings). For each batch size, `batch` requests of `context` prompt tokens are prefilled, then
decode steps (LLMEngine.step) are timed, then run under torch.profiler:

    step       wall time of a decode step, host work included (median, not profiled)
    GPU busy   the step's kernels and copies, summed (one stream: no two overlap)
    floor      the bytes the step must read, every weight once (the input embedding is a
               lookup) and each row's K/V so far, over the device-to-device copy bandwidth
               measured here: no decode step can take less

and a table of the kernels with the largest share of GPU busy, then the shares by kind (gemm,
attention, compiled ops, ...). Kernels replayed from a CUDA graph are not seen by every
profiler build: when a step shows fewer kernels than the model has layers, the step is
profiled again with the graphs off (the same kernels, launched one by one) and says so.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from benchmarks.decode_step import decode_until_all_running
from benchmarks.engines import kv_bytes_per_token, weight_bytes_per_step
from nanovllm import LLM, SamplingParams
from nanovllm.demo import QWEN3_0_6B_CONFIG, write_weightless_checkpoint

TOP = 8  # kernels listed a batch; the rest are summed in one line
NAME_WIDTH = 60
# A kernel's kind, from words in its name; the first match wins (inductor's kernels are named
# triton_{poi,red,per}_fused_<ops>, ours <name>_kernel, cuBLAS's by tile and architecture).
KINDS = (
    ("copy", ("memcpy", "memset")),
    ("kv store", ("store_kvcache",)),
    ("attention", ("paged", "attention", "attn", "flash")),
    ("compiled", ("triton_",)),
    ("hot op", ("_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel")),  # fused_ops.py
    ("moe", ("moe",)),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "sm90_", "sm80_")),
    ("sampling", ("softmax", "argmax", "topk", "sort", "distribution", "exponential")),
)


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    kind: str
    us: float  # device time per step
    calls: float  # launches per step


@dataclass(frozen=True, slots=True)
class Roofline:
    weight_gb: float  # read once a step
    kv_gb: float  # every row's K/V so far
    floor_ms: float  # (weights + KV) over the copy bandwidth


def roofline(weight_bytes: float, kv_bytes: float, copy_gb_s: float) -> Roofline:
    """The least time a decode step reading these bytes can take."""
    return Roofline(weight_bytes / 1e9, kv_bytes / 1e9, (weight_bytes + kv_bytes) / copy_gb_s / 1e6)


def kind_of(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, words in KINDS if any(w in lower for w in words)), "other")


def short_name(name: str) -> str:
    """A kernel's name without C++'s noise, cut to NAME_WIDTH."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::"):
        name = name.replace(noise, "")
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."


def device_kernels(averages: Iterable, steps: int) -> list[Kernel]:
    """The device's kernels and copies from torch.profiler's key_averages(), per step, longest
    first (the host's ops, whose device time is their kernels', are left out)."""
    kernels = []
    for event in averages:
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(event, "self_device_time_total", None)
        us = event.self_cuda_time_total if us is None else us  # torch < 2.4
        kernels.append(Kernel(event.key, kind_of(event.key), us / steps, event.count / steps))
    return sorted(kernels, key=lambda k: -k.us)


def kernel_table(kernels: list[Kernel], top: int = TOP) -> list[str]:
    """The `top` longest kernels with their share of the GPU's busy time, the rest in one line,
    then the shares by kind."""
    busy = sum(k.us for k in kernels) or 1.0
    lines = [f"  {'share':>6} {'us/step':>8} {'calls':>5}  {'kind':<9} kernel"]
    for k in kernels[:top]:
        lines.append(
            f"  {k.us / busy:>6.1%} {k.us:>8.1f} {k.calls:>5.0f}  {k.kind:<9} {short_name(k.name)}"
        )
    if rest := kernels[top:]:
        us, calls = sum(k.us for k in rest), sum(k.calls for k in rest)
        lines.append(f"  {us / busy:>6.1%} {us:>8.1f} {calls:>5.0f}  {'':<9} ({len(rest)} more)")
    lines.append("  by kind: " + kind_shares(kernels))
    return lines


def kind_shares(kernels: list[Kernel]) -> str:
    """ "gemm 55% · attention 20% · ...", largest first."""
    busy = sum(k.us for k in kernels) or 1.0
    kinds: dict[str, float] = {}
    for k in kernels:
        kinds[k.kind] = kinds.get(k.kind, 0.0) + k.us
    ordered = sorted(kinds.items(), key=lambda item: -item[1])
    return " · ".join(f"{kind} {us / busy:.0%}" for kind, us in ordered)


def headline(batch: int, step_ms: float, kernels: list[Kernel], floor: Roofline, bw: float) -> str:
    """One batch's line: the step, its GPU busy time and its floor."""
    busy_ms = sum(k.us for k in kernels) / 1e3
    of_busy = f", {floor.floor_ms / busy_ms:.0%} of GPU busy" if busy_ms else ""
    return (
        f"batch {batch}: step {step_ms:.2f} ms, GPU busy {busy_ms:.2f} ms "
        f"({sum(k.calls for k in kernels):.0f} kernels); floor {floor.floor_ms:.3f} ms = "
        f"(weights {floor.weight_gb:.3f} + KV {floor.kv_gb:.3f} GB) at {bw:,.0f} GB/s: "
        f"{floor.floor_ms / step_ms:.0%} of the step{of_busy}"
    )


# -- on the GPU -----------------------------------------------------------------------------


def copy_bandwidth_gb_s(gib: int = 2) -> float:
    """A device-to-device copy's bytes read and written per second, the best of 10."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (gib << 30) / best / 1e6


def step_ms(llm: LLM, steps: int) -> float:
    """Median wall time of a decode step (each ends in its host sync)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = llm.step()
        times.append((time.perf_counter() - start) * 1e3)
        assert not out.num_prefill_tokens, "a profiled step must decode only"
    return statistics.median(times)


def profiled_kernels(llm: LLM, steps: int) -> list[Kernel]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    return device_kernels(prof.key_averages(), steps)


@contextmanager
def graphs_off(llm: LLM) -> Iterator[None]:
    """Decode steps launch their kernels one by one (the fallback when the profiler does not
    see a graph's kernels)."""
    runner = llm.model_runner
    graphs, runner.fast_decode = runner.fast_decode, None
    try:
        yield
    finally:
        runner.fast_decode = graphs


def profile_batch(llm: LLM, batch: int, context: int, steps: int, g: torch.Generator) -> dict:
    params = SamplingParams(temperature=0.6, max_tokens=3 * steps + 8, ignore_eos=True)
    for _ in range(batch):  # token ids below 10000, as nano-vLLM's benchmark
        llm.add_request(torch.randint(0, 10000, (context,), generator=g).tolist(), params)
    decode_until_all_running(llm)
    measured = step_ms(llm, steps)
    kernels, source = profiled_kernels(llm, steps), "graphs"
    if sum(k.calls for k in kernels) < QWEN3_0_6B_CONFIG["num_hidden_layers"]:
        with graphs_off(llm):
            kernels = profiled_kernels(llm, steps)
        source = "graphs off: the profiler did not see the graph's kernels"
    while not llm.is_finished():
        llm.step()
    return {"batch": batch, "step_ms": measured, "source": source, "kernels": kernels}


def batch_figures(r: dict, floor: Roofline) -> dict:
    """One batch's figures for --json (scripts/gpu_check.py's summary reads them)."""
    kernels = r["kernels"]
    return {
        "batch": r["batch"],
        "step_ms": r["step_ms"],
        "gpu_busy_ms": sum(k.us for k in kernels) / 1e3,
        "kernels_per_step": sum(k.calls for k in kernels),
        **asdict(floor),
        "by_kind": kind_shares(kernels),
        "source": r["source"],
        "top": [asdict(k) for k in kernels[:TOP]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=5, help="decode steps timed and profiled")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_profile.py needs a CUDA GPU")
    bw = copy_bandwidth_gb_s()
    weights = weight_bytes_per_step(QWEN3_0_6B_CONFIG, itemsize=2)
    kv_per_token = kv_bytes_per_token(QWEN3_0_6B_CONFIG, itemsize=2)
    print(
        f"{torch.cuda.get_device_name()}: copy bandwidth {bw:,.0f} GB/s; Qwen3-0.6B shape, "
        f"bfloat16, CUDA graphs, context {args.context}",
        flush=True,
    )
    g, results = torch.Generator().manual_seed(0), []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_weightless_checkpoint(os.path.join(tmp, "qwen3-0.6b"))
        with LLM(
            path,
            load_format="dummy",
            dtype="bfloat16",
            max_num_seqs=max(args.batch),
            max_model_len=args.context + 4 * args.steps + 64,
        ) as llm:
            for batch in args.batch:
                r = profile_batch(llm, batch, args.context, args.steps, g)
                # the timed steps' mean context: step i reads context + i + 1 tokens' K/V
                kv = batch * (args.context + (args.steps + 1) / 2) * kv_per_token
                floor = roofline(weights, kv, bw)
                print(f"\n{headline(batch, r['step_ms'], r['kernels'], floor, bw)}")
                if r["source"] != "graphs":
                    print(f"  ({r['source']})")
                print("\n".join(kernel_table(r["kernels"])), flush=True)
                results.append(batch_figures(r, floor))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_gb_s": bw, "batches": results}, f)


if __name__ == "__main__":
    main()
