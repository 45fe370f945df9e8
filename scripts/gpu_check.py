"""Everything about nanovllm's CUDA path that needs a GPU, checked and measured in one
run that ends with a short table. Run it through scripts/gpu_check.sh.

Stages, in this order (the most wanted first), each in its own process group with a time
limit; the limits add up to BUDGET_S, so that every stage gets its whole limit, the run
ends within 8 minutes on an H200 and the table always prints:

    tests          pytest -m cuda over the test files that carry the mark
    bench graphs   nano-vLLM's benchmark workload (Qwen3-0.6B shape, random weights,
                   bfloat16; 256 requests, prompt and output lengths 100-1024) through
                   bench.py with CUDA graphs; without bench.py, the same workload through
                   LLM.generate (--throughput)
    profile        benchmarks/decode_profile.py: one decode step at 1 and 256 rows under
                   torch.profiler, its top kernels and their share of the GPU's time, and
                   the step against its memory floor (the copy bandwidth measured there);
                   with that bandwidth, a roofline line for each bench run
    decode step    benchmarks/decode_step.py: host vs GPU time per decode step
    bench async    the bench with graphs and async scheduling
    compiled ops   benchmarks/compiled_ops.py: the hot ops eager, torch.compile'd and as their
                   Triton kernels (kernels/fused_ops.py), GPU time from a graph's replay

Others run when named with --stages (alone they fit; beside the ones above they would not):

    bench eager            the bench with enforce_eager
    decode kernel          benchmarks/decode_attention.py: the kernel against its memory floor
    bench mistral-7b       the bench's workload on Mistral-7B's shape
    bench qwen3-30b-a3b    and on Qwen3-30B-A3B's (MoE; random weights route near-uniformly)

Without a CUDA GPU it prints the versions, says that no CUDA GPU is present and exits 0.
Without pytest the tests are reported as not run (gpu_check.sh puts a copy installed with
`pip install --target .gpu_deps pytest` on the path). Every stage's output is echoed and
kept in one gpu_check.log beside summary.json in --out (default: $OUT when set, else a
temporary directory): two files, so that all of it comes back from a lent machine.
"""

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 470  # the default stages' share of the 8 minutes (versions and the table take the rest)
MIN_STAGE_S = 20  # a stage with less time left than this is skipped
# Each stage's time limit, seconds. The default stages' add up to BUDGET_S (a test holds it): a
# stage that needs more takes it from another. The tests are ~125, a third of them kernel cases
# that compile in a second or so each. A bench stage starts an engine (compiling the hot ops and
# capturing 35 decode graphs: cold in the first, warm from the compile caches after) before its
# ~7 s of timed work; the compiled ops compile twice each (dynamic shapes, but a size of 1 is
# specialized, as in the engine).
LIMITS = {
    "tests": 180,
    "bench graphs": 95,
    "profile": 45,
    "decode step": 35,
    "bench async": 65,
    "compiled ops": 50,
    "bench eager": 70,
    "decode kernel": 30,
    "bench mistral-7b": 150,
    "bench qwen3-30b-a3b": 240,
}
DEFAULT_STAGES = ("tests", "bench graphs", "profile", "decode step", "bench async", "compiled ops")
# a bench stage: bench.py's --preset and flags
BENCHES = {
    "bench graphs": ("qwen3-0.6b", []),
    "bench async": ("qwen3-0.6b", ["--async-scheduling"]),
    "bench eager": ("qwen3-0.6b", ["--enforce-eager"]),
    "bench mistral-7b": ("mistral-7b-v0.3", []),
    "bench qwen3-30b-a3b": ("qwen3-30b-a3b", []),
}
NO_GPU = "no CUDA GPU is present: the CUDA checks need one, nothing was run"


@dataclass
class Stage:
    name: str
    status: str = "not run"  # ok | failed (exit N) | timed out | skipped (...) | not run (...)
    seconds: float = 0.0
    summary: str = ""
    figures: dict = field(default_factory=dict)


class Runner:
    """Runs stages one after another within a budget, echoing and logging their output."""

    def __init__(self, out: Path, budget_s: float = BUDGET_S):
        self.out = out  # summary.json and gpu_check.log only; the rest goes to scratch
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu_check-scratch-"))
        self.deadline = time.monotonic() + budget_s
        self.stages: list[Stage] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, argv: list[str], limit_s: float) -> tuple[Stage, str]:
        stage = Stage(name)
        self.stages.append(stage)
        limit = min(limit_s, self.left())
        if limit < MIN_STAGE_S:
            stage.status = "skipped (out of time)"
            return stage, ""
        print(f"\n=== {name}: {' '.join(argv)} (limit {limit:.0f} s)", flush=True)
        start = time.monotonic()
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=child_env(),
        )
        try:
            output, _ = proc.communicate(timeout=limit)
            stage.status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            output, _ = proc.communicate()
            stage.status = f"timed out ({limit:.0f} s)"
        _kill_group(proc.pid)  # helpers it left behind (compile workers, TP ranks)
        stage.seconds = time.monotonic() - start
        print(output, end="", flush=True)
        with open(self.out / "gpu_check.log", "a") as log:  # one log: few files come back
            log.write(f"\n=== {name}: {' '.join(argv)} [{stage.status}, {stage.seconds:.0f} s]\n")
            log.write(output)
        return stage, output


def child_env() -> dict:
    env = dict(os.environ)
    paths = [str(ROOT)] + ([str(ROOT / ".gpu_deps")] if (ROOT / ".gpu_deps").is_dir() else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


# -- stages ---------------------------------------------------------------------------


def versions() -> dict:
    import torch

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "missing"

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": version("triton"),
        "transformers": version("transformers"),
        "pytest": _importable("pytest"),
        "hypothesis": _importable("hypothesis"),
        "flash_attn": version("flash-attn"),
        "commit": os.environ.get("NANOVLLM_COMMIT") or _git("rev-parse", "--short", "HEAD"),
        "date": time.strftime("%Y-%m-%d"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, "
            f"{torch.cuda.device_count()} visible"
        )
    return info


def _importable(module: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}; print({module}.__version__)"],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
    )
    return proc.stdout.strip() if proc.returncode == 0 else "missing"


def _git(*args: str) -> str:
    try:
        proc = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)
    except OSError:
        return "unknown"
    return proc.stdout.strip() or "unknown"


def cuda_test_files() -> list[str]:
    """Test files that mark CUDA tests; other files are not even imported (they may need
    packages the image lacks, e.g. hypothesis)."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "pytest.mark.cuda" in p.read_text()
    )


def run_tests(runner: Runner, name: str, limit_s: float, pytest_version: str) -> None:
    if pytest_version == "missing":
        runner.stages.append(Stage(name, "not run (pytest missing: see gpu_check.sh)"))
        return
    junit = runner.scratch / "cuda_tests.xml"
    stage, output = runner.run(
        name,
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "cuda",
            "-q",
            "-rfEs",
            "--durations=20",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *cuda_test_files(),
        ],
        limit_s,
    )
    counts = junit_counts(junit) if junit.exists() else progress_counts(output)
    stage.figures = counts
    stage.summary = (
        f"{counts['passed']} passed, {counts['failures']} failed, "
        f"{counts['errors']} errors, {counts['skipped']} skipped"
        + ("" if junit.exists() else " (until it stopped)")
    )


def junit_counts(junit: Path) -> dict[str, int]:
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("failures", "errors", "skipped")}
    counts["passed"] = int(suite.get("tests", 0)) - sum(counts.values())
    return counts


def progress_counts(output: str) -> dict[str, int]:
    """Counts from pytest -q's progress lines ("..F.s  [ 40%]"), for a run cut short
    before it wrote its report."""
    marks = "".join(
        m.group(1) for m in re.finditer(r"(?m)^([.FEsxX]+)(?:\s+\[\s*\d+%\])?$", output)
    )
    return {
        "passed": marks.count(".") + marks.count("X"),
        "failures": marks.count("F"),
        "errors": marks.count("E"),
        "skipped": marks.count("s") + marks.count("x"),
    }


def run_bench(runner: Runner, name: str, limit_s: float) -> None:
    """bench.py's workload on a preset's shape (BENCHES), bfloat16."""
    preset, flags = BENCHES[name]
    result = runner.scratch / f"{name.replace(' ', '_')}.json"
    if (ROOT / "bench.py").exists():
        argv = [sys.executable, "bench.py", "--preset", preset, "--dtype", "bfloat16"]
    elif name in ("bench graphs", "bench eager"):
        argv = [sys.executable, str(Path(__file__)), "--throughput"]
    else:
        runner.stages.append(Stage(name, "not run (no bench.py in this checkout)"))
        return
    stage, _ = runner.run(name, argv + ["--json", str(result)] + flags, limit_s)
    if stage.status != "ok" or not result.exists():
        return
    r = stage.figures = json.loads(result.read_text())["results"][0]
    if r.get("status") != "ok" or "output_tok_s" not in r:
        stage.status = f"failed ({r.get('status')}: {r.get('error', '')[-200:]})"
        return
    stage.summary = f"{r['output_tok_s']:,.0f} output tok/s in {r['time_s']:.2f} s"
    if r.get("mean_decode_step_ms"):
        stage.summary += f", decode {r['mean_decode_step_ms']:.2f} ms/step"


def run_profile(runner: Runner, name: str, limit_s: float) -> None:
    result = runner.scratch / "profile.json"
    argv = [sys.executable, "-m", "benchmarks.decode_profile", "--json", str(result)]
    stage, _ = runner.run(name, argv, limit_s)
    if stage.status == "ok" and result.exists():
        stage.figures = json.loads(result.read_text())
        stage.summary = profile_summary(stage.figures)


def profile_summary(profile: dict) -> str:
    """Each batch's step, GPU busy time and floor, and its three largest kinds of kernel."""
    return "; ".join(
        f"batch {b['batch']}: step {b['step_ms']:.2f} ms, GPU busy {b['gpu_busy_ms']:.2f} ms "
        f"in {b['kernels_per_step']:.0f} kernels, floor {b['floor_ms']:.3f} ms "
        f"({b['floor_ms'] / b['step_ms']:.0%} of the step); "
        + " · ".join(b["by_kind"].split(" · ")[:3])
        for b in profile["batches"]
    )


def bench_roofline(bench: dict, copy_gb_s: float) -> str:
    """A bench run's mean decode step against its memory floor: what the step must read
    (bench.py's decode figures: every weight once, each row's K/V so far) over the copy
    bandwidth."""
    weights, kv = bench["decode_weight_gb_per_step"], bench["decode_kv_gb_per_step"]
    floor_ms = (weights + kv) / copy_gb_s * 1e3
    step_ms = bench["mean_decode_step_ms"]
    return (
        f"a mean decode step reads {weights + kv:.2f} GB (weights {weights:.2f} + KV {kv:.2f}: "
        f"{bench['mean_decode_rows']:.0f} rows x {bench['mean_decode_context']:.0f} tokens): "
        f"floor {floor_ms:.2f} ms at {copy_gb_s:,.0f} GB/s, measured {step_ms:.2f} ms "
        f"({floor_ms / step_ms:.0%} of the step)"
    )


def roofline_rows(stages: list[Stage]) -> list[tuple[str, str]]:
    """(name, line) for each bench run with decode figures, once the profile has measured the
    copy bandwidth (not the MoE shape's: bench.py's weight bytes count a dense MLP)."""
    profile = next((s for s in stages if s.name == "profile" and s.figures), None)
    if profile is None:
        return []
    return [
        (f"{s.name} floor", bench_roofline(s.figures, profile.figures["copy_bandwidth_gb_s"]))
        for s in stages
        if s.name.startswith("bench")
        and s.name != "bench qwen3-30b-a3b"
        and s.figures.get("decode_weight_gb_per_step")
    ]


def run_decode_step(runner: Runner, name: str, limit_s: float) -> None:
    argv = [sys.executable, "benchmarks/decode_step.py", "--steps", "10"]
    stage, output = runner.run(name, argv, limit_s)
    rows = [line.split() for line in output.splitlines() if re.match(r"\s*\d+\s+\d", line)]
    if rows:  # batch step gpu host schedule launch wait post launch-busy
        stage.figures = {
            row[0]: dict(
                zip(
                    ("step", "gpu", "host", "schedule", "launch", "wait", "post", "launch_busy"),
                    map(float, row[1:]),
                )
            )
            for row in rows
        }
        stage.summary = "; ".join(
            f"batch {b}: step {f['step']:.2f} = gpu {f['gpu']:.2f} + host {f['host']:.2f} ms, "
            f"launch {f['launch']:.2f} idle / {f['launch_busy']:.2f} busy"
            for b, f in stage.figures.items()
        )


def run_percentages(
    runner: Runner, name: str, argv: list[str], limit_s: float, pattern: str, unit: str
) -> None:
    """A benchmark whose table ends each row in a ratio: report their range."""
    if not (ROOT / argv[1]).exists():
        runner.stages.append(Stage(name, f"not run ({argv[1]} is not in this checkout)"))
        return
    stage, output = runner.run(name, argv, limit_s)
    values = [float(v) for v in re.findall(pattern, output)]
    if values:
        stage.figures = {"min": min(values), "max": max(values), "rows": len(values)}
        stage.summary = (
            f"{min(values):g}{unit} .. {max(values):g}{unit} over {len(values)} rows (above)"
        )


def run_decode_kernel(runner: Runner, name: str, limit_s: float) -> None:
    argv = [sys.executable, "benchmarks/decode_attention.py"]
    run_percentages(runner, name, argv, limit_s, r"(?m)(\d+)%\s*$", "% of floor")


def run_compiled_ops(runner: Runner, name: str, limit_s: float) -> None:
    result = runner.scratch / "compiled_ops.json"
    argv = [sys.executable, "benchmarks/compiled_ops.py", "--tokens", "1", "256", "2048"]
    stage, output = runner.run(name, argv + ["--json", str(result)], limit_s)
    if stage.status == "ok" and result.exists():
        stage.figures = json.loads(result.read_text())
        stage.summary = compiled_ops_summary(stage.figures)
    elif rows := re.findall(r"(?m)^\w+\s+\d+\s+[\d.]+\s", output):
        stage.summary = f"{len(rows)} rows before it stopped (above)"


def compiled_ops_summary(figures: dict) -> str:
    """What the hot ops cost a forward of the model each way, the ops compiled slower than
    eager, and those whose Triton kernel was the fastest at every size (TRITON_HOT_OPS's
    candidates)."""
    costs = "; ".join(
        f"{tokens} tokens: " + ", ".join(f"{impl} {us:,.0f}" for impl, us in step.items())
        for tokens, step in figures["per_step"].items()
    )
    slower = [
        f"{r['op']} at {r['tokens']}" for r in figures["rows"] if r["compiled_us"] > r["eager_us"]
    ]
    triton = [op for op, best in figures["fastest"].items() if set(best) == {"triton"}]
    return (
        f"hot ops per forward, us: {costs}; compiled slower than eager: "
        f"{', '.join(slower) or 'none'}; Triton fastest at every size: "
        f"{', '.join(triton) or 'none'}"
    )


def run_stages(runner: Runner, info: dict, names: Sequence[str] = DEFAULT_STAGES) -> None:
    """The stages `names`, in that order, each within its limit; the time each took is printed
    as it ends."""
    runs: dict[str, Callable[[Runner, str, float], None]] = {
        "tests": partial(run_tests, pytest_version=info["pytest"]),
        "profile": run_profile,
        "decode step": run_decode_step,
        "compiled ops": run_compiled_ops,
        "decode kernel": run_decode_kernel,
        **dict.fromkeys(BENCHES, run_bench),
    }
    for name in names:
        runs[name](runner, name, LIMITS[name])
        stage = runner.stages[-1]
        print(
            f"--- {name}: {stage.status} in {stage.seconds:.0f} s "
            f"(limit {LIMITS[name]} s; {runner.left():.0f} s of the budget left)",
            flush=True,
        )


# -- the table ------------------------------------------------------------------------


def print_table(info: dict, stages: list[Stage]) -> None:
    rows = [
        ("GPU", info.get("gpu", "none")),
        (
            "versions",
            f"python {info['python']}, torch {info['torch']} (CUDA {info['cuda']}), "
            f"triton {info['triton']}, transformers {info['transformers']}, "
            f"pytest {info['pytest']}, flash-attn {info['flash_attn']}",
        ),
        ("commit", f"{info['commit']} ({info['date']})"),
    ]
    for s in stages:
        status = f"[{s.status}, {s.seconds:.0f} s]"
        rows.append((s.name, f"{s.summary}  {status}" if s.summary else status))
    rows += roofline_rows(stages)
    width = max(len(name) for name, _ in rows)
    print("\n" + "-" * 78)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print("-" * 78, flush=True)


def check(out: Path, stages: Sequence[str] = DEFAULT_STAGES) -> int:
    info = versions()
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    if "gpu" not in info:
        print(NO_GPU)
        print_table(info, [])
        return 0
    runner = Runner(out, budget_s=sum(LIMITS[name] for name in stages))
    run_stages(runner, info, stages)
    (out / "summary.json").write_text(
        json.dumps(
            {"info": info, "stages": [asdict(s) for s in runner.stages]}, indent=2, default=str
        )
    )
    print_table(info, runner.stages)
    return 0 if all(s.status == "ok" for s in runner.stages) else 1


# -- the workload without bench.py -----------------------------------------------------------


def throughput(enforce_eager: bool, json_path: str) -> None:
    """nano-vLLM's bench.py workload through LLM.generate, its figures to `json_path`."""
    from random import randint, seed

    from nanovllm import LLM, SamplingParams
    from nanovllm.demo import write_weightless_checkpoint

    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024))
        for _ in range(256)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_weightless_checkpoint(os.path.join(tmp, "qwen3-0.6b"))
        with LLM(
            path,
            load_format="dummy",
            dtype="bfloat16",
            enforce_eager=enforce_eager,
            max_model_len=4096,
        ) as llm:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm up
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
    tokens = sum(p.max_tokens for p in params)
    print(f"Total: {tokens}tok, Time: {elapsed:.2f}s, Throughput: {tokens / elapsed:.2f}tok/s")
    with open(json_path, "w") as f:
        json.dump(
            {
                "results": [
                    {
                        "status": "ok",
                        "output_tokens": tokens,
                        "time_s": elapsed,
                        "output_tok_s": tokens / elapsed,
                    }
                ]
            },
            f,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        default=os.environ.get("OUT"),
        help="where the logs go (default: $OUT, else a temporary directory)",
    )
    p.add_argument(
        "--stages",
        nargs="+",
        metavar="STAGE",
        help="run these stages instead (names as in the table, '-' for a space, e.g. "
        f"bench-mistral-7b), each within its limit; any of: {', '.join(LIMITS)}",
    )
    p.add_argument(
        "--throughput",
        action="store_true",
        help="(internal) run only the benchmark workload through LLM.generate",
    )
    p.add_argument("--enforce-eager", action="store_true", help="(with --throughput)")
    p.add_argument("--json", help="(with --throughput) where its figures go")
    args = p.parse_args()
    if args.throughput:
        throughput(args.enforce_eager, args.json)
        return
    stages = [name.replace("-", " ") for name in args.stages or DEFAULT_STAGES]
    if unknown := [name for name in stages if name not in LIMITS]:
        p.error(f"unknown stage(s) {', '.join(unknown)}; the stages: {', '.join(LIMITS)}")
    sys.exit(check(Path(args.out or tempfile.mkdtemp(prefix="gpu_check-")), stages))


if __name__ == "__main__":
    main()
