"""CPU linears that keep oneDNN-prepacked weights: the same products as F.linear, the copy used
only from 2 to PACKED_MAX_ROWS rows (one float32 row: our GEMV), and a runner that packs only
when the copies fit its memory."""

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy

import nanovllm.layers.linear as linear_module
import nanovllm.runner.cpu as runner_cpu
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu_step
from nanovllm.layers.linear import (
    PACKED_MAX_ROWS,
    PACKED_MIN_WEIGHT,
    LinearBase,
    linear,
    pack_linear_weights,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("rows", [1, 7, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_linear_computes_what_f_linear_does(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(96, 64, generator=g), torch.randn(rows, 64, generator=g)
    bias = torch.randn(96, generator=g) if with_bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    got = linear(x, weight, bias, packed)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_one_row_and_rows_above_the_limit_use_the_dense_weight():
    """At 1 row (float32: kernels/cpu_step.py's GEMV, other dtypes F.linear) and past
    PACKED_MAX_ROWS the packed copy is not read: a wrong one changes nothing; between them it is."""
    weight = torch.randn(8, 16)
    wrong = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 16), None)
    x = torch.randn(PACKED_MAX_ROWS + 1, 16)
    assert torch.equal(linear(x, weight, None, wrong), F.linear(x, weight))
    one = linear(x[:1], weight, None, wrong)
    torch.testing.assert_close(one, F.linear(x[:1], weight), rtol=1e-5, atol=1e-5)
    if (library := cpu_step.load()) is not None:  # the GEMV's own sums
        assert torch.equal(one, cpu_step.f32_linear(library, x[:1], weight, None))
    half = x[:1].bfloat16(), weight.bfloat16()
    assert torch.equal(linear(*half, None, wrong), F.linear(*half))
    assert linear(x[:2], weight, None, wrong).eq(0).all()


@pytest.fixture
def pack_every_size(monkeypatch):
    """The test checkpoints' layers are all below PACKED_MIN_WEIGHT: pack them anyway."""
    monkeypatch.setattr(linear_module, "PACKED_MIN_WEIGHT", 0)


def packed_layers(llm: LLM) -> list[bool]:
    return [m.packed is not None for m in llm.model_runner.model.modules() if hasattr(m, "packed")]


def test_a_cpu_engine_packs_every_linear_and_the_lm_head_and_matches_transformers(
    checkpoints, caplog, pack_every_size
):
    path = str(checkpoints["gqa"])
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        with LLM(path, device="cpu") as llm:
            assert all(packed_layers(llm)) and llm.model_runner.model.lm_head.packed is not None
            out = llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)
    assert "CPU linears: oneDNN-packed weights for" in caplog.text
    assert out[0]["token_ids"] == hf_greedy(path, (5, 6, 7, 8), 12)


def test_weights_below_the_minimum_stay_on_f_linear(checkpoints):
    with LLM(str(checkpoints["gqa"]), device="cpu") as llm:  # every weight < PACKED_MIN_WEIGHT
        assert not any(packed_layers(llm))
    small, big = LinearBase(256, 255, bias=False), LinearBase(256, 256, bias=False)
    assert big.weight.numel() == PACKED_MIN_WEIGHT
    assert pack_linear_weights(torch.nn.ModuleList([small, big])) == 1
    assert small.packed is None and big.packed is not None


def test_no_copies_when_they_would_not_fit_a_quarter_of_the_memory(
    checkpoints, monkeypatch, caplog, pack_every_size
):
    monkeypatch.setattr(runner_cpu, "physical_memory", lambda: 1024)
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        with LLM(str(checkpoints["gqa"]), device="cpu") as llm:
            assert not any(packed_layers(llm))
    assert "would exceed a quarter of the RAM" in caplog.text


def test_a_dtype_onednn_cannot_pack_leaves_every_layer_on_f_linear(
    checkpoints, monkeypatch, caplog, pack_every_size
):
    calls = []

    def fail_on_the_third(weight, batch_size):
        calls.append(weight.shape)
        if len(calls) == 3:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs avx512bw\nmore")
        return real(weight, batch_size)

    real = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", fail_on_the_third)
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        with LLM(str(checkpoints["gqa"]), device="cpu") as llm:
            assert not any(packed_layers(llm))
    assert "F.linear only (mkldnn_reorder_linear_weight: bf16 path needs avx512bw)" in caplog.text


def test_a_packed_layer_gives_its_dense_output_and_undo_drops_the_copy(pack_every_size):
    layer = LinearBase(16, 8, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    pack_linear_weights(layer)
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    pack_linear_weights(layer, undo=True)
    assert layer.packed is None
