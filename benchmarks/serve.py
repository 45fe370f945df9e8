"""Online serving: N concurrent streaming clients (the official openai client) against
nanovllm's OpenAI-compatible server and, with --vllm-venv, vLLM's own, the same requests
through each.

    python benchmarks/serve.py --preset cpu-small --num-clients 16 --num-requests 64 \
        --vllm-venv ~/vllm-venv
    python benchmarks/serve.py --url http://127.0.0.1:8000/v1 --num-requests 64
    python benchmarks/serve.py --preset cpu-small --hostile-clients 2

The requests are bench.py's workload (seeded random token-id prompts, prompt and output
lengths uniform in the preset's ranges); each streams a completion of exactly its output
length (ignore_eos, temperature 0) with the usage in its last chunk. Each client sends its
next request when the previous one ends. Reported per server: output tokens per second
over the run (first request sent to last chunk), time to first token (TTFT: sent -> first
chunk with text), inter-token latency (ITL: the gaps between a request's text chunks)
and time per output token (TPOT: a request's first-to-last chunk time over its tokens
less one; unlike ITL it does not shrink when a server sends several tokens in a burst)
at p50 and p99. A server started here runs in its own process group, killed afterwards.

With --hostile-clients N the normal load runs three times on the same server: alone, beside N
hostile clients (benchmarks/hostile.py: dropped streams and responses, half bodies, oversized
prompts, bad bodies), and alone again, each with the workload of its own seed (the same
prompts again would hit the prefix cache); the table gives the normal requests' figures of
each run, the hostile run's TTFT p99 over the mean of the two alone, and what the hostile
clients got back.
"""

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.py, benchmarks/

import bench  # noqa: E402
from benchmarks.compare import kill_group  # noqa: E402
from benchmarks.hostile import HostileMix  # noqa: E402
from nanovllm.demo import write_weightless_checkpoint  # noqa: E402

NAME = "bench-model"  # the served model name, on both servers


class Sample(NamedTuple):
    ttft_s: float
    itl_s: list[float]  # gaps between text chunks
    tpot_s: float  # (last chunk - first chunk) / (output tokens - 1)
    output_tokens: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset",
        default="cpu-small",
        choices=sorted(bench.PRESETS),
        help="the model shape (random weights) and workload (default cpu-small)",
    )
    p.add_argument("--url", help="benchmark this running server (its /v1 URL) instead")
    p.add_argument("--num-clients", type=int, default=16, help="(default 16)")
    p.add_argument("--num-requests", type=int, default=64, help="(default 64)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--kv-cache-gib", type=float, default=2.0, help="CPU KV cache of both servers (default 2)"
    )
    p.add_argument("--vllm-venv", help="also run vLLM's server from this venv")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds (default 600)")
    p.add_argument(
        "--hostile-clients",
        type=int,
        default=0,
        help="also run the load beside this many hostile clients (default 0: not)",
    )
    return p.parse_args(argv)


def make_requests(args: argparse.Namespace, seed: int | None = None) -> list[tuple[list[int], int]]:
    preset = bench.PRESETS[args.preset]
    lengths = {
        name: preset.workload.get(name, default) for name, default in bench.DEFAULT_WORKLOAD.items()
    }
    seed = args.seed if seed is None else seed
    workload = bench.make_workload(
        argparse.Namespace(**dict(lengths, num_seqs=args.num_requests), seed=seed),
        preset.config["vocab_size"],
    )
    return list(zip(workload.prompts, workload.output_lens))


# -- the clients ------------------------------------------------------------------------------


async def one_request(client, model: str, prompt: list[int], max_tokens: int) -> Sample:
    sent = time.perf_counter()
    arrivals, output_tokens = [], 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            output_tokens = chunk.usage.completion_tokens
    return Sample(
        arrivals[0] - sent,
        [b - a for a, b in zip(arrivals, arrivals[1:])],
        (arrivals[-1] - arrivals[0]) / max(1, output_tokens - 1),
        output_tokens,
    )


async def run_clients(
    base_url: str, model: str | None, requests: list[tuple[list[int], int]], num_clients: int
) -> dict:
    import openai

    async with openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", timeout=3600, max_retries=0
    ) as client:
        model = model or (await client.models.list()).data[0].id
        for prompt, _ in requests[:2]:  # warm-up, not timed
            await one_request(client, model, prompt, 8)
        pending = list(reversed(requests))
        samples: list[Sample] = []

        async def worker() -> None:
            while pending:
                samples.append(await one_request(client, model, *pending.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(num_clients)))
        elapsed = time.perf_counter() - start
    itl = [gap for s in samples for gap in s.itl_s]
    return {
        "output_tok_s": sum(s.output_tokens for s in samples) / elapsed,
        "time_s": elapsed,
        "ttft_ms": percentiles([s.ttft_s for s in samples]),
        "itl_ms": percentiles(itl),
        "tpot_ms": percentiles([s.tpot_s for s in samples]),
        "output_tokens": sum(s.output_tokens for s in samples),
    }


def percentiles(values_s: list[float]) -> tuple[float, float]:
    """p50 and p99, in milliseconds."""
    cuts = statistics.quantiles(values_s, n=100, method="inclusive")
    return 1000 * statistics.median(values_s), 1000 * cuts[98]


# -- the servers ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nanovllm_command(model: str, port: int, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "nanovllm",
        "serve",
        model,
        "--port",
        str(port),
        "--served-model-name",
        NAME,
        "--load-format",
        "dummy",
        "--cpu-kvcache-space-gib",
        str(args.kv_cache_gib),
    ]


def vllm_command(model: str, port: int, args: argparse.Namespace) -> list[str]:
    dtype = bench.PRESETS[args.preset].config.get("torch_dtype", "auto")
    return [
        os.path.join(os.path.expanduser(args.vllm_venv), "bin", "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--served-model-name",
        NAME,
        "--load-format",
        "dummy",
        "--dtype",
        dtype,
    ]


def serve_and_measure(
    command: list[str],
    port: int,
    args: argparse.Namespace,
    requests: list[tuple[list[int], int]],
    env: dict[str, str],
) -> dict[str, dict]:
    """Start a server in its own process group, run the clients (alone, and beside the
    hostile ones if asked), kill the group. Rows by name."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=dict(os.environ, **env),
        )
        try:
            wait_healthy(port, proc, args.start_timeout, log)
            url = f"http://127.0.0.1:{port}/v1"
            if not args.hostile_clients:
                return {"": asyncio.run(run_clients(url, NAME, requests, args.num_clients))}
            return measure_beside_hostile_clients(url, port, args)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    pass
            kill_group(proc.pid)


def measure_beside_hostile_clients(url: str, port: int, args: argparse.Namespace) -> dict:
    """Alone, beside the hostile clients, alone again: each with a workload of its own."""
    rows, beside = {}, f"+ {args.hostile_clients} hostile"
    for run, (name, hostile) in enumerate(
        (("alone", False), (beside, True), ("alone again", False))
    ):
        requests = make_requests(args, args.seed + run)
        if not hostile:
            rows[name] = asyncio.run(run_clients(url, NAME, requests, args.num_clients))
            continue
        with HostileMix("127.0.0.1", port, NAME, args.hostile_clients) as mix:
            rows[name] = asyncio.run(run_clients(url, NAME, requests, args.num_clients))
        rows[name]["hostile"] = mix.counts
    alone_p99 = (rows["alone"]["ttft_ms"][1] + rows["alone again"]["ttft_ms"][1]) / 2
    rows[beside]["ttft_p99_ratio"] = rows[beside]["ttft_ms"][1] / alone_p99
    return rows


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float, log) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"the server exited ({proc.returncode}):\n{log.read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"no healthy server on port {port} after {timeout_s:.0f}s")


def print_table(rows: dict[str, dict], args: argparse.Namespace) -> None:
    with open("/proc/cpuinfo") as f:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?"
        )
    print(
        f"CPU: {cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
        f"{args.num_requests} requests, {args.num_clients} clients, preset {args.preset}"
    )
    print(
        "| server | output tok/s | time (s) | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
        "TPOT p50 / p99 (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['output_tok_s']:.1f} | {r['time_s']:.2f} | "
            f"{r['ttft_ms'][0]:.0f} / {r['ttft_ms'][1]:.0f} | "
            f"{r['itl_ms'][0]:.1f} / {r['itl_ms'][1]:.1f} | "
            f"{r['tpot_ms'][0]:.1f} / {r['tpot_ms'][1]:.1f} |"
        )
    for name, r in rows.items():
        if "hostile" in r:
            print(
                f"\n{name}: TTFT p99 {r['ttft_p99_ratio']:.2f}x that of the runs alone; "
                f"the hostile clients sent {sum(r['hostile'].values())} requests:"
            )
            for outcome, count in sorted(r["hostile"].items()):
                print(f"  {outcome}: {count}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    requests = make_requests(args)
    if args.url:
        print_table(
            {args.url: asyncio.run(run_clients(args.url, None, requests, args.num_clients))}, args
        )
        return
    rows = {}
    with tempfile.TemporaryDirectory(prefix=f"serve-{args.preset}-") as model:
        write_weightless_checkpoint(model, bench.PRESETS[args.preset].config)
        port = free_port()
        measured = serve_and_measure(nanovllm_command(model, port, args), port, args, requests, {})
        rows.update({f"nanovllm {run}".strip(): row for run, row in measured.items()})
        if args.vllm_venv:
            port = free_port()
            measured = serve_and_measure(
                vllm_command(model, port, args),
                port,
                args,
                requests,
                {"VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gib:g}"},
            )
            rows.update({f"vllm {run}".strip(): row for run, row in measured.items()})
    print_table(rows, args)


if __name__ == "__main__":
    main()
