"""A fleet of nanovllm replicas behind vLLM's router (`pip install vllm-router`), on 127.0.0.1,
each replica a CPU process of one thread:

    python benchmarks/fleet.py                            # all three measurements
    python benchmarks/fleet.py --only scale --replicas 1 2 --num-requests 48

1. scale: throughput and TTFT p50/p99 through the router with 1, 2, 3 replicas (and one replica
   called directly): benchmarks/serve.py's clients and workload (the cpu-small preset's seeded
   random prompts, streamed completions of exactly their output length), and the CPU seconds
   the router, the replicas and the clients (this process) used meanwhile: on a machine with
   fewer cores than they need, what the replicas could add goes to the others.
2. prefix: the prefix cache's hit rate on a multi-turn workload under the router's cache_aware
   and round_robin policies (2 replicas), and on one replica (every turn where its prefix is,
   the ceiling): conversations sent side by side, each turn's prompt its previous prompt, the
   answer and a new message; from the replicas' `nanovllm:prefix_cache_hits_total` over
   `..._queries_total`.
3. overhead: the router's added latency: one client, short streamed requests one at a time, in
   turn to a replica directly and through the router: TTFT and whole-request latency p50/p99.

Replicas run with vLLM's KV block size, 16 (--block-size), and --shutdown-timeout 30. Every
process started here runs in a process group of its own, killed afterwards; a replica that
logged a traceback is reported on stderr. The router's
flags are the fleet recipe of docs/serving.md (ROUTER_RECIPE), which tests/test_fleet.py runs.
"""

import argparse
import asyncio
import itertools
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.py, benchmarks/

import bench  # noqa: E402
from benchmarks.compare import kill_group  # noqa: E402
from benchmarks.serve import (  # noqa: E402
    NAME,
    free_port,
    make_requests,
    nanovllm_command,
    percentiles,
    run_clients,
    wait_healthy,
)
from nanovllm.demo import write_weightless_checkpoint  # noqa: E402

# The router's flags of the fleet recipe: /health checked every second, one failure takes a
# replica out (a draining one answers 503 there), retries back off long enough to outlast that
# second (a 503 or a refused connection is retried, on another replica once the first is out),
# and a replica whose circuit opened is tried again after 5 s (a restarted one comes back).
ROUTER_RECIPE = (
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "1",
    "--retry-max-retries",
    "8",
    "--retry-initial-backoff-ms",
    "100",
    "--retry-max-backoff-ms",
    "1000",
    "--cb-timeout-duration-secs",
    "5",
)
START_TIMEOUT_S = 120


def router_missing() -> str | None:
    """Why the router cannot run here, or None."""
    import importlib.util

    # vllm_router is its launcher, vllm_router_rs the router (Rust, in the wheel)
    if any(importlib.util.find_spec(m) is None for m in ("vllm_router", "vllm_router_rs")):
        return (
            "vllm-router is not installed in this environment (pip install vllm-router: its "
            "wheels are built for Linux x86_64 and aarch64; the test extras install it there)"
        )
    return None


def router_command(workers: list[str], port: int, policy: str = "cache_aware") -> list[str]:
    """vllm-router in front of `workers` (their base URLs), on 127.0.0.1:port."""
    return [
        sys.executable,
        "-m",
        "vllm_router.launch_router",
        "--worker-urls",
        *workers,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",  # its own metrics, on a port no other run holds
        str(free_port()),
        "--policy",
        policy,
        *ROUTER_RECIPE,
    ]


def wait_router(url: str, proc: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until the router answers /v1/models (it has found a healthy worker)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no router at {url} after {timeout_s:.0f}s")


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(nanovllm:\w+)\{[^}]*\} (\S+)$", text, re.M)}


# -- processes ----------------------------------------------------------------------------------


@contextmanager
def process_group(command: list[str], env: dict[str, str] | None = None):
    """`command` in a session of its own, its output in a temporary file: yields the process and
    the file. SIGTERM, then SIGKILL to the group, at the end; a traceback in the output is
    reported on stderr."""
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=dict(os.environ, **(env or {})),
        )
        try:
            yield proc, log
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    pass
            kill_group(proc.pid)
            proc.wait()
            log.seek(0)
            if "Traceback" in (output := log.read()):
                print(f"{command[:4]} logged a traceback:\n{output[-4000:]}", file=sys.stderr)


def replica_flags(args: argparse.Namespace) -> list[str]:
    """vLLM's block size (nano-vLLM's 256 would find a conversation's prefix only in whole
    256-token blocks) and --shutdown-timeout, the fleet recipe's."""
    return ["--kvcache-block-size", str(args.block_size), "--shutdown-timeout", "30"]


class Running(NamedTuple):
    url: str  # the router's
    workers: list[str]  # the replicas' URLs
    router_pid: int
    replica_pids: list[int]

    def cpu_s(self) -> tuple[float, float]:
        """CPU seconds the router and the replicas (all together) have used so far."""
        return cpu_seconds(self.router_pid), sum(map(cpu_seconds, self.replica_pids))


def cpu_seconds(pid: int) -> float:
    """A process's user and system time, its threads' included (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def fleet(model: str, num_replicas: int, args: argparse.Namespace, policy: str = "cache_aware"):
    """`num_replicas` replicas of `model` (one thread each) and a router in front of them."""
    with ExitStack() as stack:
        ports, pids = [free_port() for _ in range(num_replicas)], []
        for port in ports:
            command = [*nanovllm_command(model, port, args), *replica_flags(args)]
            proc, log = stack.enter_context(process_group(command, {"OMP_NUM_THREADS": "1"}))
            wait_healthy(port, proc, START_TIMEOUT_S, log)
            pids.append(proc.pid)
        workers = [f"http://127.0.0.1:{port}" for port in ports]
        port = free_port()
        router, _ = stack.enter_context(process_group(router_command(workers, port, policy)))
        url = f"http://127.0.0.1:{port}"
        wait_router(url, router)
        yield Running(url, workers, router.pid, pids)


# -- 1. throughput and TTFT with 1, 2, 3 replicas ---------------------------------------------


def scale(model: str, args: argparse.Namespace) -> dict[str, dict]:
    """The same requests to one replica directly, then through the router to 1, 2, 3."""
    rows, requests = {}, make_requests(args)
    for n in (0, *args.replicas):  # 0: one replica, called directly
        with fleet(model, max(n, 1), args) as running:
            url = running.url if n else running.workers[0]
            before = (*running.cpu_s(), time.process_time())
            row = asyncio.run(run_clients(f"{url}/v1", NAME, requests, args.num_clients))
            after = (*running.cpu_s(), time.process_time())
            row["cpu_s"] = [b - a for a, b in zip(before, after)]  # router, replicas, clients
        rows[f"{n} replica{'s' if n > 1 else ''}, router" if n else "1 replica, direct"] = row
    return rows


# -- 2. the prefix cache under cache_aware and round_robin ----------------------------------


def conversations(args: argparse.Namespace, vocab_size: int) -> list[list[str]]:
    """Each conversation's messages, the first long: words of the placeholder tokenizer, one
    token each ("<17>"), so that a prompt of text is a prompt of known tokens."""
    rng = random.Random(args.seed)

    def words(n: int) -> str:
        return " ".join(f"<{rng.randrange(2, vocab_size)}>" for _ in range(n))

    return [
        [words(args.first_turn_tokens)] + [words(args.turn_tokens) for _ in range(args.turns - 1)]
        for _ in range(args.conversations)
    ]


async def converse(url: str, talks: list[list[str]], answer_tokens: int) -> None:
    """Every conversation at once, each one turn after another: a turn's prompt is the
    previous prompt, its answer and the next message."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:

        async def talk(messages: list[str]) -> None:
            prompt = ""
            for message in messages:
                prompt = f"{prompt} {message}".strip()
                out = await c.completions.create(
                    model=NAME,
                    prompt=prompt,
                    max_tokens=answer_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                prompt = f"{prompt} {out.choices[0].text.strip()}"

        await asyncio.gather(*(talk(messages) for messages in talks))


def hit_rate(model: str, args: argparse.Namespace, replicas: int, policy: str) -> dict:
    talks = conversations(args, bench.PRESETS[args.preset].config["vocab_size"])
    with fleet(model, replicas, args, policy) as running:
        before = [metrics(w) for w in running.workers]
        start = time.perf_counter()
        asyncio.run(converse(running.url, talks, args.answer_tokens))
        elapsed = time.perf_counter() - start
        after = [metrics(w) for w in running.workers]

    def delta(name: str) -> list[float]:
        return [a[f"nanovllm:{name}"] - b[f"nanovllm:{name}"] for a, b in zip(after, before)]

    hits, queries = delta("prefix_cache_hits_total"), delta("prefix_cache_queries_total")
    return {
        "hit_rate": sum(hits) / sum(queries),
        "per_replica": [f"{h / q:.0%} of {q:.0f}" for h, q in zip(hits, queries)],
        "time_s": elapsed,
    }


def prefix(model: str, args: argparse.Namespace) -> dict[str, dict]:
    return {
        "1 replica (the ceiling)": hit_rate(model, args, 1, "cache_aware"),
        "2 replicas, cache_aware": hit_rate(model, args, 2, "cache_aware"),
        "2 replicas, round_robin": hit_rate(model, args, 2, "round_robin"),
    }


# -- 3. the router's added latency -----------------------------------------------------------


async def latencies(urls: dict[str, str], num: int, prompt: str, max_tokens: int) -> dict:
    """Per URL, `num` requests of each kind, sent one at a time and in turn to each: streamed
    (TTFT, and the whole request) and whole (not streamed)."""
    import openai

    samples = {name: {"ttft": [], "streamed": [], "whole": []} for name in urls}
    clients = {n: openai.AsyncOpenAI(base_url=f"{u}/v1", api_key="x") for n, u in urls.items()}
    first_token = itertools.count(2)  # each prompt's own: no prefix-cache hit
    for i in range(num + 2):  # the first two of each warm up
        for name, client in clients.items():
            request = dict(model=NAME, max_tokens=max_tokens)
            sent, first = time.perf_counter(), None
            streaming = await client.completions.create(
                **request, prompt=f"<{next(first_token)}> {prompt}", stream=True
            )
            async for chunk in streaming:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter()
            streamed = time.perf_counter()
            await client.completions.create(**request, prompt=f"<{next(first_token)}> {prompt}")
            if i >= 2:
                samples[name]["ttft"].append(first - sent)
                samples[name]["streamed"].append(streamed - sent)
                samples[name]["whole"].append(time.perf_counter() - streamed)
    for client in clients.values():
        await client.close()
    return {
        name: {kind: percentiles(values) for kind, values in kinds.items()}
        for name, kinds in samples.items()
    }


def overhead(model: str, args: argparse.Namespace) -> dict[str, dict]:
    prompt = " ".join(f"<{i}>" for i in range(10, 25))  # after one of its own: 16 tokens
    with fleet(model, 1, args) as running:
        urls = {"direct": running.workers[0], "through the router": running.url}
        return asyncio.run(latencies(urls, args.num_latency, prompt, args.latency_tokens))


# -- the report --------------------------------------------------------------------------------


def machine() -> str:
    with open("/proc/cpuinfo") as f:
        cpu = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "?")
    return f"CPU: {cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}"


def header(argv: list[str] | None) -> str:
    """The command, the date, the commit and the machine, before anything runs."""
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent,
    )
    commit = git.stdout.strip() if git.returncode == 0 else "unknown"
    command = " ".join(["python benchmarks/fleet.py", *(sys.argv[1:] if argv is None else argv)])
    return f"{command}\n{time.strftime('%Y-%m-%d %H:%M')}, commit {commit}; {machine()}"


def print_scale(rows: dict[str, dict], args: argparse.Namespace) -> None:
    print(f"\n{machine()}; {args.num_requests} requests, {args.num_clients} clients, {args.preset}")
    if max(args.replicas) > os.cpu_count():
        print(
            f"({max(args.replicas)} one-thread replicas and the router on {os.cpu_count()} cores: "
            "oversubscribed, the replicas take turns on the cores)"
        )
    print(
        "| replicas | output tok/s | time (s) | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | "
        "CPU s: router / replicas / clients |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['output_tok_s']:.1f} | {r['time_s']:.1f} | "
            f"{r['ttft_ms'][0]:.0f} / {r['ttft_ms'][1]:.0f} | "
            f"{r['tpot_ms'][0]:.1f} / {r['tpot_ms'][1]:.1f} | "
            f"{' / '.join(f'{x:.1f}' for x in r['cpu_s'])} |"
        )


def print_prefix(rows: dict[str, dict], args: argparse.Namespace) -> None:
    print(
        f"\n{machine()}; {args.conversations} conversations of {args.turns} turns "
        f"({args.first_turn_tokens} tokens, then {args.turn_tokens} a turn, answers of "
        f"{args.answer_tokens})"
    )
    print("| fleet | prefix-cache hit rate | per replica | time (s) |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        per = ", ".join(r["per_replica"])
        print(f"| {name} | {r['hit_rate']:.1%} | {per} | {r['time_s']:.1f} |")


def print_overhead(rows: dict[str, dict], args: argparse.Namespace) -> None:
    print(
        f"\n{machine()}; {args.num_latency} requests of each kind, 16 prompt tokens, "
        f"{args.latency_tokens} generated"
    )
    print(
        "| path | streamed: TTFT p50 / p99 (ms) | streamed: whole p50 / p99 (ms) | "
        "not streamed p50 / p99 (ms) |"
    )
    print("|---|---|---|---|")
    for name, r in rows.items():
        cells = " | ".join(f"{r[k][0]:.1f} / {r[k][1]:.1f}" for k in ("ttft", "streamed", "whole"))
        print(f"| {name} | {cells} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("scale", "prefix", "overhead"), help="one measurement")
    p.add_argument("--preset", default="cpu-small", choices=sorted(bench.PRESETS))
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3], help="(default 1 2 3)")
    p.add_argument("--num-requests", type=int, default=96, help="scale (default 96)")
    p.add_argument("--num-clients", type=int, default=16, help="scale (default 16)")
    p.add_argument("--seed", type=int, default=0, help="workloads' seed (default 0)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="per replica (default 1)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    p.add_argument("--conversations", type=int, default=8, help="prefix (default 8)")
    p.add_argument("--turns", type=int, default=4, help="prefix (default 4)")
    p.add_argument("--first-turn-tokens", type=int, default=256, help="prefix (default 256)")
    p.add_argument("--turn-tokens", type=int, default=32, help="prefix (default 32)")
    p.add_argument("--answer-tokens", type=int, default=16, help="prefix (default 16)")
    p.add_argument("--num-latency", type=int, default=40, help="overhead (default 40)")
    p.add_argument("--latency-tokens", type=int, default=8, help="overhead (default 8)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if reason := router_missing():
        raise SystemExit(reason)
    print(header(argv), flush=True)
    with tempfile.TemporaryDirectory(prefix=f"fleet-{args.preset}-") as model:
        write_weightless_checkpoint(model, bench.PRESETS[args.preset].config)
        if args.only in (None, "scale"):
            print_scale(scale(model, args), args)
        if args.only in (None, "prefix"):
            print_prefix(prefix(model, args), args)
        if args.only in (None, "overhead"):
            print_overhead(overhead(model, args), args)


if __name__ == "__main__":
    main()
