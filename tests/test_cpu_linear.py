"""CPU linears that read oneDNN-prepacked weights (platforms/cpu/weights.py, a weight format):
the same products as F.linear, the copy used only from 2 to PACKED_MAX_ROWS rows (one float32
row: our GEMV), and a platform that packs only when the copies fit its memory."""

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy

import nanovllm.platforms.cpu.weights as weights_module
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu_step
from nanovllm.layers.linear import LinearBase
from nanovllm.platforms.cpu.weights import (
    PACKED_MAX_ROWS,
    PACKED_MIN_WEIGHT,
    PackedWeight,
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
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    got = PackedWeight(weight).linear(x, bias)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_one_row_and_rows_above_the_limit_use_the_dense_weight():
    """At 1 row (float32: kernels/cpu_step.py's GEMV, other dtypes F.linear) and past
    PACKED_MAX_ROWS the packed copy is not read: a wrong one changes nothing; between them it is."""
    weight = torch.randn(8, 16)
    wrong = PackedWeight(weight)
    wrong.blocked = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 16), None)
    x = torch.randn(PACKED_MAX_ROWS + 1, 16)
    assert torch.equal(wrong.linear(x, None), F.linear(x, weight))
    one = wrong.linear(x[:1], None)
    torch.testing.assert_close(one, F.linear(x[:1], weight), rtol=1e-5, atol=1e-5)
    if (library := cpu_step.load()) is not None:  # the GEMV's own sums
        assert torch.equal(one, cpu_step.f32_linear(library, x[:1], weight, None))
    wrong.weight = weight.bfloat16()
    assert torch.equal(
        wrong.linear(x[:1].bfloat16(), None), F.linear(x[:1].bfloat16(), wrong.weight)
    )
    assert wrong.linear(x[:2], None).eq(0).all()


@pytest.fixture
def pack_every_size(monkeypatch):
    """The test checkpoints' layers are all below PACKED_MIN_WEIGHT: pack them anyway."""
    monkeypatch.setattr(weights_module, "PACKED_MIN_WEIGHT", 0)


def is_packed(layer: torch.nn.Module) -> bool:
    return isinstance(layer.weight_format, PackedWeight)


def packed_layers(llm: LLM) -> list[bool]:
    modules = llm.model_runner.model.modules()
    return [is_packed(m) for m in modules if hasattr(m, "weight_format")]


def test_a_cpu_engine_packs_every_linear_and_the_lm_head_and_matches_transformers(
    checkpoints, caplog, pack_every_size
):
    path = str(checkpoints["gqa"])
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        with LLM(path, device="cpu") as llm:
            assert all(packed_layers(llm)) and is_packed(llm.model_runner.model.lm_head)
            out = llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)
    assert "CPU linear layers: 9 of 9 read a copy of their weight in oneDNN's layout" in caplog.text
    assert out[0]["token_ids"] == hf_greedy(path, (5, 6, 7, 8), 12)


def test_weights_below_the_minimum_stay_on_f_linear(checkpoints):
    with LLM(str(checkpoints["gqa"]), device="cpu") as llm:  # every weight < PACKED_MIN_WEIGHT
        assert not any(packed_layers(llm))
    small, big = LinearBase(256, 255, bias=False), LinearBase(256, 256, bias=False)
    assert big.weight.numel() == PACKED_MIN_WEIGHT
    assert pack_linear_weights(torch.nn.ModuleList([small, big])) == 1
    assert small.weight_format is None and is_packed(big)


def test_no_copies_when_they_would_not_fit_a_quarter_of_the_memory(
    checkpoints, monkeypatch, caplog, pack_every_size
):
    monkeypatch.setattr(weights_module, "physical_memory", lambda: 1024)
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
    message = "F.linear only (oneDNN cannot repack them: mkldnn_reorder_linear_weight: bf16 path"
    assert message + " needs avx512bw)" in caplog.text


def test_a_packed_layer_gives_its_dense_output_and_undo_drops_the_copy(pack_every_size):
    layer = LinearBase(16, 8, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    pack_linear_weights(layer)
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    pack_linear_weights(layer, undo=True)
    assert layer.weight_format is None
