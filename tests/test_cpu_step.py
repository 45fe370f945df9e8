"""The CPU's native decode step (platforms/cpu/decode_step.py, kernels/cpu_step.cpp): its
float32 GEMM against a float64 reference, and the engine with it against transformers' greedy
tokens and against the eager engine's logprobs, for every dense family, float32, int8 and int4
weights (and a model mixing int8 and int4 layers); a weight format it cannot read keeps it off."""

import pytest
import torch
from conftest import hf_greedy, native_library

from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu_int4, cpu_int8, cpu_step
from nanovllm.platforms.cpu.decode_step import (
    F32_MAX_ROWS,
    F32_MAX_ROWS_CACHED,
    INT4_MAX_ROWS,
    INT8_MAX_ROWS,
    NativeDecodeStep,
    f32_max_rows,
)

EPS32 = 2.0**-24


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_f32_linear_matches_a_float64_reference(rows, threads):
    library = native_library(cpu_step.load)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(rows)
        # K around the vector widths (8, 16: the loop takes 2 vectors), N around 4 and 64
        for n, k in [(1, 1), (3, 15), (4, 16), (5, 31), (63, 32), (64, 33), (130, 257), (300, 512)]:
            x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
            for bias in (None, torch.randn(n, generator=g)):
                got = cpu_step.f32_linear(library, x, w, bias).double()
                want = x.double() @ w.double().T + (0 if bias is None else bias.double())
                # a float32 sum of k products is off by at most ~k ulps of the sum of |terms|
                bound = (k + 2) * EPS32 * (x.double().abs() @ w.double().abs().T + 1)
                assert got.shape == (rows, n)
                assert ((got - want).abs() <= bound).all(), (n, k, bias is None)
    finally:
        torch.set_num_threads(before)


def _generate(path, prompts, params, **kwargs):
    with LLM(str(path), device="cpu", max_model_len=256, **kwargs) as llm:
        runner = llm.model_runner.fast_decode
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return runner, [o.outputs[0] for o in outs]


PROMPTS = [list(range(3, 3 + n)) for n in (4, 11, 23)]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_the_native_step_decodes_as_the_eager_model(families, quantization):
    """Every dense family: greedy tokens and logprobs equal the eager engine's (their GEMMs, the
    LM head's too, sum in another order: within 1e-4), batches of 1 to 3 rows; float32 tokens
    equal transformers'."""
    native_library(cpu_step.load)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    for name, path in families.items():
        kwargs = dict(dtype="float32", quantization=quantization)
        runner, native = _generate(path, PROMPTS, params, **kwargs)  # the step is the default
        if "moe" in name:
            assert runner is None, name  # MoE layers run the eager model
            continue
        assert isinstance(runner, NativeDecodeStep) and runner.step is None  # closed
        assert not runner.eager_head  # the LM head ran inside the step too
        _, eager = _generate(path, PROMPTS, params, enforce_eager=True, **kwargs)
        for a, b in zip(native, eager):
            assert a.token_ids == b.token_ids, name
            for x, y, token in zip(a.logprobs, b.logprobs, a.token_ids):
                assert abs(x[token].logprob - y[token].logprob) < 1e-4, name
        if quantization is None:
            for prompt, out in zip(PROMPTS, native):
                assert out.token_ids == hf_greedy(str(path), tuple(prompt), 12), name


def test_larger_batches_and_other_dtypes_run_the_eager_model(checkpoints):
    path = checkpoints["gqa"]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [[5 + i, 7, 9] for i in range(F32_MAX_ROWS_CACHED + 3)]
    with LLM(str(path), device="cpu", dtype="float32") as llm:  # on by default
        step = llm.model_runner.fast_decode
        limit = F32_MAX_ROWS_CACHED  # a tiny model's layers stay in the caches
        assert step.can_run(limit) and not step.can_run(limit + 1)
        calls = []
        run = step.run
        step.run = lambda *args: calls.append(len(args[0])) or run(*args)
        big = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert calls == []  # limit + 3 rows a step: eager
        small = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        assert calls == [1, 1]  # the two decode steps after the prefill
    assert big[0].outputs[0].token_ids == small[0].outputs[0].token_ids
    # int8 and int4 weights run the same GEMM kernel either way: the step takes larger batches
    for method, limit, kernel in (
        ("int8", INT8_MAX_ROWS, cpu_int8),
        ("int4", INT4_MAX_ROWS, cpu_int4),
    ):
        if kernel.load() is None:
            continue
        with LLM(str(path), device="cpu", dtype="float32", quantization=method) as llm:
            step = llm.model_runner.fast_decode
            assert step.can_run(limit) and not step.can_run(limit + 1)
        quantized = dict(dtype="float32", quantization=method, enforce_eager=True)
        with LLM(str(path), device="cpu", **quantized) as llm:
            assert llm.model_runner.fast_decode is None
    # half precision runs the eager model; so do enforce_eager and cpu_decode_step=False
    with LLM(str(path), device="cpu", dtype="bfloat16") as llm:
        assert llm.model_runner.fast_decode is None
    for off in (dict(enforce_eager=True), dict(cpu_decode_step=False)):
        with LLM(str(path), device="cpu", dtype="float32", **off) as llm:
            assert llm.model_runner.fast_decode is None, off


def test_a_model_whose_layers_stream_from_memory_takes_fewer_float32_rows(tmp_path):
    """Qwen3-0.6B's layers (63 MB of float32 weights each): the eager layers' packed GEMM is the
    faster from 3 rows there; the tests' tiny model runs up to F32_MAX_ROWS_CACHED natively."""
    from transformers import AutoConfig

    from nanovllm.demo import QWEN3_0_6B_CONFIG, write_weightless_checkpoint
    from nanovllm.models.registry import get_model_class

    config = AutoConfig.from_pretrained(write_weightless_checkpoint(tmp_path, QWEN3_0_6B_CONFIG))
    with torch.device("meta"):
        model = get_model_class(config)(config)
    assert f32_max_rows(model) == F32_MAX_ROWS < F32_MAX_ROWS_CACHED


def test_cpu_decode_step_must_be_a_bool(checkpoints):
    with pytest.raises(TypeError, match="cpu_decode_step"):
        LLM(str(checkpoints["gqa"]), device="cpu", cpu_decode_step="yes")


def test_layers_of_int8_and_int4_weights_mixed_run_the_step_as_the_eager_model(
    checkpoints, monkeypatch
):
    """A quantized checkpoint may mix formats (GGUF's Q4_K_M: int4 and int8 tensors): each
    linear runs its own kernel in the step, which decodes as the eager model; its row limit is
    the least of its kinds'."""
    from nanovllm.quantization import int4
    from nanovllm.quantization.int8 import Int8Weight

    native_library(cpu_step.load)
    made = []

    def int8_for_o_and_down(weight, group_size):  # [64, in]: o_proj, down_proj
        made.append(weight.shape[0] <= 64)
        if made[-1]:
            return Int8Weight(weight)
        return int4.Int4Weight(*cpu_int4.quantize(weight, group_size), group_size)

    monkeypatch.setattr(int4.Int4Weight, "from_float", staticmethod(int8_for_o_and_down))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    kwargs = dict(dtype="float32", quantization="int4")
    runner, native = _generate(checkpoints["gqa"], PROMPTS, params, **kwargs)
    assert isinstance(runner, NativeDecodeStep) and runner.max_rows == min(
        INT8_MAX_ROWS, INT4_MAX_ROWS
    )
    _, eager = _generate(checkpoints["gqa"], PROMPTS, params, enforce_eager=True, **kwargs)
    assert any(made) and not all(made)
    for a, b in zip(native, eager):
        assert a.token_ids == b.token_ids
        for x, y, token in zip(a.logprobs, b.logprobs, a.token_ids):
            assert abs(x[token].logprob - y[token].logprob) < 1e-4


def test_a_weight_format_the_step_cannot_read_keeps_it_off(checkpoints, monkeypatch):
    """A format without native_linear (here int4's, hidden from it) leaves the decode to the
    eager model."""
    from nanovllm.quantization import int4

    monkeypatch.delattr(int4.Int4Weight, "native_linear")
    kwargs = dict(dtype="float32", quantization="int4")
    with LLM(str(checkpoints["gqa"]), device="cpu", **kwargs) as llm:
        assert llm.model_runner.fast_decode is None
