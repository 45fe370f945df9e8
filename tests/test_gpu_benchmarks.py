"""The GPU benchmarks' arithmetic and tables from figures made up here: benchmarks/decode_profile.py
(a profile's kernels, their kinds and shares, a step's floor) and benchmarks/compiled_ops.py (what
the hot ops cost a forward). The measurements need a GPU: scripts/gpu_check.sh runs them."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import decode_profile  # noqa: E402
from benchmarks.decode_profile import Kernel  # noqa: E402

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def event(key: str, device_us: float, count: int, device_type=CUDA) -> SimpleNamespace:
    """One row of torch.profiler's key_averages()."""
    return SimpleNamespace(
        key=key, self_device_time_total=device_us, count=count, device_type=device_type
    )


GEMM = "nvjet_tst_128x8_64x3_2x1_v_bz_TNN"
FILL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"


def fake_profile() -> list[SimpleNamespace]:
    """Two steps: a host op (its device time is its kernels'), GEMMs, attention, a copy."""
    return [
        event("aten::mm", 900.0, 4, device_type=CPU),
        event(GEMM, 600.0, 112),
        event("_paged_decode_kernel", 300.0, 56),
        event("Memcpy HtoD (Pinned -> Device)", 40.0, 10),
        event("triton_poi_fused_mul_silu_0", 60.0, 56),
    ]


def test_device_kernels_are_per_step_and_longest_first_without_the_hosts_ops():
    kernels = decode_profile.device_kernels(fake_profile(), steps=2)
    assert kernels == [
        Kernel(GEMM, "gemm", 300.0, 56.0),
        Kernel("_paged_decode_kernel", "attention", 150.0, 28.0),
        Kernel("triton_poi_fused_mul_silu_0", "compiled", 30.0, 28.0),
        Kernel("Memcpy HtoD (Pinned -> Device)", "copy", 20.0, 5.0),
    ]


@pytest.mark.parametrize(
    "name,kind",
    [
        (GEMM, "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "gemm"),
        ("_store_kvcache_kernel", "kv store"),
        ("_paged_decode_merge_kernel", "attention"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "compiled"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "sampling"),
        ("Memset (Device)", "copy"),
        ("_rms_norm_kernel", "hot op"),
        (FILL, "other"),
    ],
)
def test_a_kernels_kind_comes_from_its_name(name, kind):
    assert decode_profile.kind_of(name) == kind


def test_the_table_lists_the_top_kernels_sums_the_rest_and_gives_shares_by_kind():
    kernels = decode_profile.device_kernels(fake_profile(), steps=2)
    lines = decode_profile.kernel_table(kernels, top=2)
    assert lines == [
        "   share  us/step calls  kind      kernel",
        f"   60.0%    300.0    56  gemm      {GEMM}",
        "   30.0%    150.0    28  attention _paged_decode_kernel",
        "   10.0%     50.0    33            (2 more)",
        "  by kind: gemm 60% · attention 30% · compiled 6% · copy 4%",
    ]


def test_long_kernel_names_lose_cpp_noise_and_are_cut():
    assert decode_profile.short_name(FILL) == "vectorized_elementwise_kernel<4, FillFunctor<float>>"
    long = FILL.replace("float", "c10::BFloat16, at::detail::Array<char*, 2>")
    name = decode_profile.short_name(long)
    assert len(name) == decode_profile.NAME_WIDTH and name.endswith("...")
    assert name == "vectorized_elementwise_kernel<4, FillFunctor<c10::BFloat1..."


def test_the_floor_is_the_bytes_read_over_the_copy_bandwidth():
    floor = decode_profile.roofline(weight_bytes=1.2e9, kv_bytes=0.3e9, copy_gb_s=3000.0)
    assert floor.weight_gb == 1.2 and floor.kv_gb == 0.3
    assert floor.floor_ms == pytest.approx(0.5)
    line = decode_profile.headline(1, 2.0, [Kernel(GEMM, "gemm", 1000.0, 300.0)], floor, 3000.0)
    assert line == (
        "batch 1: step 2.00 ms, GPU busy 1.00 ms (300 kernels); floor 0.500 ms = "
        "(weights 1.200 + KV 0.300 GB) at 3,000 GB/s: 25% of the step, 50% of GPU busy"
    )


# -- benchmarks/compiled_ops.py's sums ------------------------------------------------------


def test_a_forwards_hot_ops_cost_each_ops_calls_times_its_time_and_the_fastest_is_named():
    from benchmarks import compiled_ops

    rows = [
        dict(op="add_rms_norm", tokens=1, eager_us=10.0, compiled_us=4.0, triton_us=3.0),
        dict(op="softmax_race", tokens=1, eager_us=50.0, compiled_us=20.0, triton_us=None),
        dict(op="add_rms_norm", tokens=8, eager_us=12.0, compiled_us=5.0, triton_us=6.0),
    ]
    calls = compiled_ops.CALLS_PER_STEP["add_rms_norm"]
    assert calls == 56  # 28 layers, two norms each after a residual add
    steps = compiled_ops.per_step(rows)
    # an op without a Triton kernel runs compiled in the Triton column, as the platform runs it
    assert steps[1] == {
        "eager": calls * 10 + 50,
        "compiled": calls * 4 + 20,
        "triton": calls * 3 + 20,
    }
    cpu = [dict(r, triton_us=None) for r in rows]
    assert compiled_ops.per_step(cpu)[1] == {"eager": calls * 10 + 50, "compiled": calls * 4 + 20}
    assert compiled_ops.fastest(rows) == {
        "add_rms_norm": ["triton", "compiled"],
        "softmax_race": ["compiled"],
    }
