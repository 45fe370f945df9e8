"""scripts/gpu_check.sh, the one command for a GPU box, as far as a CPU can take it: it
reports that no GPU is present and exits cleanly; and the CUDA tests it selects with
`-m cuda` are all the tests that need CUDA."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: it would run it all")
def test_without_a_gpu_it_says_so_and_exits_cleanly(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert load_gpu_check().NO_GPU in lines
    assert any(
        line.startswith("versions") and f"torch {torch.__version__}" in line for line in lines
    )
    assert lines[-1] == "-" * 78  # the table comes last


def test_it_runs_the_files_with_cuda_tests_and_no_others():
    files = load_gpu_check().cuda_test_files()
    assert "tests/test_cuda.py" in files and "tests/kernels/test_paged_attention.py" in files
    assert "tests/test_scheduler_properties.py" not in files  # hypothesis may be missing


class FakeRunner:
    """gpu_check's Runner without processes: every stage fails at once, its limit recorded."""

    def __init__(self, scratch: Path):
        self.scratch, self.stages, self.limits = scratch, [], {}

    def run(self, name: str, argv: list[str], limit_s: float):
        self.limits[name] = limit_s
        self.stages.append(load_gpu_check().Stage(name, "failed (exit 1)", seconds=1.0))
        return self.stages[-1], ""

    def left(self) -> float:
        return 0.0


def test_the_default_stages_each_get_their_limit_and_end_within_8_minutes(tmp_path, capsys):
    gpu_check = load_gpu_check()
    runner = FakeRunner(tmp_path)
    gpu_check.run_stages(runner, {"pytest": "8.0"})
    assert list(runner.limits) == list(gpu_check.DEFAULT_STAGES)
    assert runner.limits == {name: gpu_check.LIMITS[name] for name in gpu_check.DEFAULT_STAGES}
    assert sum(runner.limits.values()) <= gpu_check.BUDGET_S <= 8 * 60 - 10  # versions, table
    limit = gpu_check.LIMITS["profile"]
    assert f"--- profile: failed (exit 1) in 1 s (limit {limit} s;" in capsys.readouterr().out


def test_every_stage_can_be_run_by_name_within_its_limit(tmp_path):
    gpu_check = load_gpu_check()
    runner = FakeRunner(tmp_path)
    gpu_check.run_stages(runner, {"pytest": "8.0"}, list(gpu_check.LIMITS))
    assert runner.limits == gpu_check.LIMITS
    assert all(limit <= gpu_check.BUDGET_S for limit in gpu_check.LIMITS.values())


def test_an_unknown_stage_name_is_refused_with_the_list_of_stages():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--stages", "bench-mistral"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown stage(s) bench mistral; the stages: tests, bench graphs" in proc.stderr


class _Collected:
    def __init__(self):
        self.items = []

    def pytest_collection_modifyitems(self, items):
        self.items = list(items)


@pytest.mark.slow
def test_every_test_that_skips_without_cuda_carries_the_cuda_mark():
    collected = _Collected()
    pytest.main(
        ["--collect-only", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")], plugins=[collected]
    )

    def skips_without_cuda(item) -> bool:
        return any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))

    assert len(collected.items) > 100
    unmarked = [
        item.nodeid
        for item in collected.items
        if skips_without_cuda(item) and item.get_closest_marker("cuda") is None
    ]
    assert unmarked == []


# -- the profile and the rooflines, from figures made up here ----------------------------------


def bench_figures(step_ms: float) -> dict:
    """A bench run's decode figures (benchmarks/engines.py's decode_figures)."""
    return {
        "mean_decode_step_ms": step_ms,
        "decode_weight_gb_per_step": 1.2,
        "decode_kv_gb_per_step": 2.8,
        "mean_decode_rows": 190.4,
        "mean_decode_context": 871.6,
    }


def test_a_bench_runs_roofline_is_what_its_mean_step_reads_over_the_copy_bandwidth():
    line = load_gpu_check().bench_roofline(bench_figures(step_ms=8.0), copy_gb_s=4000.0)
    # 4.0 GB at 4,000 GB/s: 1 ms, an eighth of the measured step
    assert line == (
        "a mean decode step reads 4.00 GB (weights 1.20 + KV 2.80: 190 rows x 872 tokens): "
        "floor 1.00 ms at 4,000 GB/s, measured 8.00 ms (12% of the step)"
    )


def test_rooflines_need_the_profiles_bandwidth_and_a_bench_with_decode_figures():
    gpu_check = load_gpu_check()
    Stage = gpu_check.Stage
    benches = [
        Stage("bench graphs", "ok", figures=bench_figures(2.0)),
        Stage("bench async", "failed (exit 1)"),
        Stage("bench eager", "ok", figures={"output_tok_s": 1.0}),  # the workload without bench.py
    ]
    assert gpu_check.roofline_rows(benches) == []  # no bandwidth measured
    profile = Stage("profile", "ok", figures={"copy_bandwidth_gb_s": 4000.0, "batches": []})
    rows = gpu_check.roofline_rows([*benches, profile])
    assert [name for name, _ in rows] == ["bench graphs floor"]
    assert rows[0][1].endswith("measured 2.00 ms (50% of the step)")


def test_the_profile_summary_gives_each_batchs_step_floor_and_largest_kinds():
    batch = dict(
        batch=256,
        step_ms=7.0,
        gpu_busy_ms=5.94,
        kernels_per_step=402.0,
        floor_ms=3.5,
        by_kind="attention 51% · gemm 30% · sampling 9% · compiled 6% · copy 4%",
    )
    summary = load_gpu_check().profile_summary({"batches": [batch]})
    assert summary == (
        "batch 256: step 7.00 ms, GPU busy 5.94 ms in 402 kernels, floor 3.500 ms "
        "(50% of the step); attention 51% · gemm 30% · sampling 9%"
    )


def test_the_compiled_ops_summary_names_the_slow_compiled_ops_and_the_triton_winners():
    figures = {
        "rows": [
            {"op": "silu_and_mul", "tokens": 1, "eager_us": 4.0, "compiled_us": 5.0},
            {"op": "silu_and_mul", "tokens": 256, "eager_us": 9.0, "compiled_us": 6.0},
            {"op": "softmax_race", "tokens": 1, "eager_us": 30.0, "compiled_us": 12.0},
        ],
        "per_step": {"1": {"eager": 1234.4, "compiled": 600.0, "triton": 512.6}},
        "fastest": {"silu_and_mul": ["triton", "triton"], "rotary": ["triton", "compiled"]},
    }
    assert load_gpu_check().compiled_ops_summary(figures) == (
        "hot ops per forward, us: 1 tokens: eager 1,234, compiled 600, triton 513; "
        "compiled slower than eager: silu_and_mul at 1; Triton fastest at every size: silu_and_mul"
    )
