"""bench.py: its arguments, its seeded workload, its decode figures, and tiny end-to-end
runs on the CPU (alone, and side by side with transformers)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import imported_modules

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


import bench  # noqa: E402
from benchmarks import engines  # noqa: E402
from nanovllm.demo import DOWNLOAD_COMMAND  # noqa: E402

TINY = [
    "--preset",
    "cpu-small",
    "--num-seqs",
    "4",
    "--min-input-len",
    "8",
    "--max-input-len",
    "40",
    "--min-output-len",
    "4",
    "--max-output-len",
    "12",
    "--kv-cache-gib",
    "0.05",
    "--threads",
    "1",
]
LINE = re.compile(r"^Total: (\d+)tok, Time: (\d+\.\d\d)s, Throughput: (\d+\.\d\d)tok/s$", re.M)


INTERRUPTED = re.compile(
    r"^Interrupted: (\d+) of (\d+)tok in [\d.]+s, Throughput so far: [\d.]+tok/s$", re.M
)


def run_bench(*argv: str, timeout: int = 240) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "bench.py", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# -- arguments and workload ------------------------------------------------------------


def test_default_arguments_are_nano_vllms_workload():
    args = bench.parse_args([])
    assert (args.num_seqs, args.min_input_len, args.max_input_len) == (256, 100, 1024)
    assert (args.min_output_len, args.max_output_len) == (100, 1024)
    assert (args.temperature, args.seed, args.max_model_len) == (0.6, 0, 4096)
    assert args.backend == "nanovllm" and args.peers == []


def test_preset_sets_the_workload_and_a_flag_overrides_it():
    args = bench.parse_args(["--preset", "cpu-small", "--num-seqs", "7"])
    assert args.num_seqs == 7
    assert args.max_input_len == bench.PRESETS["cpu-small"].workload["max_input_len"]


def test_compare_lists_the_peers():
    assert bench.parse_args(["--compare", "hf, vllm"]).peers == ["hf", "vllm"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--min-input-len", "50", "--max-input-len", "10"], "--min-input-len (50) is larger"),
        (["--num-seqs", "0"], "--num-seqs must be >= 1"),
        (["--max-input-len", "3000", "--max-output-len", "2000"], "exceeds --max-model-len"),
        (["--compare", "hf,trt"], "got trt"),
        (["--preset", "gpt-9"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_with_a_message_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_help_gives_three_examples_that_parse():
    epilog = bench.build_parser().format_help().split("examples:\n", 1)[1]
    commands, lines = [], iter(epilog.splitlines())
    for line in lines:
        if line.startswith("  python bench.py"):
            command = line
            while command.endswith("\\"):  # continued on the next line
                command = command[:-1] + next(lines)
            commands.append(shlex.split(command))
    assert len(commands) == 3, epilog
    for argv in commands:
        bench.parse_args(argv[2:])  # a bad example exits with argparse's usage error


def test_no_model_points_a_cpu_user_at_cpu_small_before_importing_torch(tmp_path):
    missing = tmp_path / "no-model"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "bench.py", "--model", str(missing)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert f"no model at {str(missing)!r}" in result.stderr
    assert "python bench.py --preset cpu-small" in result.stderr
    assert DOWNLOAD_COMMAND in result.stderr
    assert "torch" not in imported_modules(result.stderr)


def test_a_long_run_on_a_cpu_is_warned_of_with_its_length_and_the_preset_to_run(capsys):
    args = bench.parse_args(["--preset", "qwen3-0.6b", "--device", "cpu", "--threads", "2"])
    config = bench.PRESETS["qwen3-0.6b"].config
    bench.warn_if_long_on_a_cpu(args, config, bench.make_workload(args, config["vocab_size"]))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "--preset cpu-small" in lines[0], lines
    assert re.search(r"takes ~(\d+) min on this CPU", lines[0]).group(1) == "69", lines[0]
    args = bench.parse_args(["--preset", "cpu-small", "--device", "cpu", "--threads", "2"])
    config = bench.PRESETS["cpu-small"].config
    bench.warn_if_long_on_a_cpu(args, config, bench.make_workload(args, config["vocab_size"]))
    assert capsys.readouterr().err == ""


def test_the_cpu_estimate_errs_long_against_the_measured_run():
    """docs/benchmarks.md: Qwen3-0.6B's shape, 32 requests, 41.59 s on 2 cores (AVX2)."""
    argv = "--num-seqs 32 --min-input-len 16 --max-input-len 128 --min-output-len 16"
    args = bench.parse_args(["--preset", "qwen3-0.6b", *argv.split(), "--max-output-len", "64"])
    config = bench.PRESETS["qwen3-0.6b"].config
    estimate = bench.cpu_seconds(config, bench.make_workload(args, config["vocab_size"]), 2)
    assert 41.59 <= estimate <= 2 * 41.59


def test_same_seed_gives_the_same_workload_and_lengths_stay_in_range():
    args = bench.parse_args(
        [
            "--num-seqs",
            "50",
            "--min-input-len",
            "3",
            "--max-input-len",
            "9",
            "--min-output-len",
            "5",
            "--max-output-len",
            "6",
        ]
    )
    first, again = bench.make_workload(args, 4096), bench.make_workload(args, 4096)
    assert first == again
    assert all(3 <= len(p) <= 9 for p in first.prompts)
    assert all(5 <= n <= 6 for n in first.output_lens)
    assert {len(p) for p in first.prompts} == set(range(3, 10))  # the whole range is drawn
    assert all(0 <= t < 4096 for p in first.prompts for t in p)
    args.seed = 1
    assert bench.make_workload(args, 4096) != first


def test_token_ids_stay_inside_a_small_vocabulary():
    workload = bench.make_workload(bench.parse_args(["--num-seqs", "8"]), vocab_size=100)
    assert max(t for p in workload.prompts for t in p) == 99


# -- decode figures ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset",
    sorted(
        name
        for name, p in bench.PRESETS.items()
        if p.config["architectures"] == ["Qwen3ForCausalLM"]
    ),
)
def test_weight_bytes_per_step_counts_every_parameter_once(preset):
    from transformers import Qwen3Config

    from nanovllm.models.qwen3 import Qwen3ForCausalLM

    config = bench.PRESETS[preset].config
    hf_config = Qwen3Config(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(hf_config)
    num_params = sum(p.numel() for p in model.parameters())  # a tied matrix counts once
    assert config["tie_word_embeddings"]  # so the embedding is the LM head, read every step
    assert engines.weight_bytes_per_step(config, itemsize=2) == 2 * num_params


def test_decode_bandwidth_counts_the_kv_of_every_decode_step():
    config = bench.PRESETS["cpu-small"].config
    workload = bench.Workload(prompts=[[1, 2, 3]], output_lens=[3])
    # tokens 2 and 3 come from decode steps over 4 and 5 tokens (the first from prefill)
    result = {"num_decode_steps": 2, "decode_time_s": 0.5}
    figures = engines.decode_figures(result, config, "float32", workload)
    read = 2 * engines.weight_bytes_per_step(config, 4) + (4 + 5) * engines.kv_bytes_per_token(
        config, 4
    )
    assert figures["decode_bandwidth_gb_s"] == pytest.approx(read / 0.5 / 1e9)
    assert figures["mean_decode_step_ms"] == pytest.approx(250.0)
    # the mean step: 1 row over 4.5 tokens, the weights read once
    assert figures["mean_decode_rows"] == 1.0 and figures["mean_decode_context"] == 4.5
    assert figures["decode_weight_gb_per_step"] == engines.weight_bytes_per_step(config, 4) / 1e9
    kv_per_step = 4.5 * engines.kv_bytes_per_token(config, 4) / 1e9
    assert figures["decode_kv_gb_per_step"] == pytest.approx(kv_per_step)


# -- end to end (CPU) ----------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_run_prints_nano_vllms_line_with_every_requested_token_and_its_machine(tmp_path):
    out = run_bench(*TINY, "--device", "cpu", "--json", str(tmp_path / "result.json")).stdout
    match = LINE.search(out)
    assert match, out
    requested = bench.make_workload(bench.parse_args(TINY), 4096).num_output_tokens
    assert int(match.group(1)) == requested
    result = json.loads((tmp_path / "result.json").read_text())["results"][0]
    assert result["output_tokens"] == result["requested_output_tokens"] == requested
    assert result["prefill_time_s"] > 0 and result["decode_time_s"] > 0
    assert (
        result["num_decode_steps"]
        >= max(bench.make_workload(bench.parse_args(TINY), 4096).output_lens) - 1
    )
    # It names the CPU, its vector/matrix extensions and the dtype chosen, in both.
    machine = json.loads((tmp_path / "result.json").read_text())["machine"]
    assert f"CPU: {machine['cpu']}" in out and " ".join(machine["cpu_extensions"]) in out
    assert set(machine["cpu_extensions"]) <= set(bench.CPU_EXTENSIONS)
    assert f"Dtype: {result['dtype']}" in out and result["dtype"] == "float32"  # a float32 preset


@pytest.mark.slow
def test_compare_prints_a_row_per_engine(tmp_path):
    # This venv has no vllm: its row must say so rather than fail the run.
    result = run_bench(
        *TINY,
        "--device",
        "cpu",
        "--compare",
        "hf,vllm",
        "--vllm-python",
        sys.executable,
        "--json",
        str(tmp_path / "r.json"),
    )
    out = result.stdout
    # each engine's progress bar, passed on as it ran, to its end
    totals = re.findall(r"Generating: 100%\|[^|]*\| (\d+)/\1 ", result.stderr)
    assert len(set(totals)) == 2, result.stderr
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert re.match(r"nanovllm\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+\s+1\.00x$", rows["nanovllm"])
    assert re.match(r"hf\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+\s+[\d.]+x$", rows["hf"])
    assert "not installed" in rows["vllm"]
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    requested = bench.make_workload(bench.parse_args(TINY), 4096).num_output_tokens
    assert [r["output_tokens"] for r in results[:2]] == [requested, requested]


@pytest.mark.slow
def test_ctrl_c_in_the_timed_run_is_one_line_with_the_figures_so_far_and_status_130():
    argv = [*TINY, "--num-seqs", "256", "--min-output-len", "64", "--max-output-len", "256"]
    proc = subprocess.Popen(
        [sys.executable, "bench.py", *argv, "--device", "cpu"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=default_sigint,
    )
    stderr = read_until(proc.stderr, re.compile(rb"[\d.]+tok/s"), timeout=120)  # a step's rate
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=60)
    out, err = out.decode(), (stderr + rest).decode()
    assert proc.returncode == bench.EXIT_INTERRUPTED, err[-3000:]
    assert "Traceback" not in out + err and "Total:" not in out
    assert out.startswith("CPU: ") and len(out.splitlines()) == 2, out
    made, requested = map(int, INTERRUPTED.search(out).groups())
    assert 0 < made < requested


def default_sigint() -> None:
    """Ctrl-C in a terminal reaches a process whose SIGINT is the default; a test run started in
    the background (`cmd &` in a script) has it ignored, which its children would inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_until(pipe, pattern: re.Pattern, timeout: float) -> bytes:
    """What a child wrote to `pipe` up to the first match of `pattern`."""
    data, deadline = b"", time.monotonic() + timeout
    while not pattern.search(data):
        assert time.monotonic() < deadline, data.decode()[-2000:]
        chunk = os.read(pipe.fileno(), 4096)
        assert chunk, f"the pipe closed first: {data.decode()[-2000:]}"
        data += chunk
    return data
