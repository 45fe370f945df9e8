"""Hot ops (compilation.py): the layers take the ops their platform chooses when built (a CPU's
native twins, compiled ones on CUDA), and one compiled function serves every layer (no
per-layer recompiles). Dynamo is driven with a counting backend here, so nothing is really
compiled."""

from collections import Counter

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.compilation import compiled_ops
from nanovllm.demo import build_tiny_qwen3
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.layernorm import RMSNorm, add_rms_norm, rms_norm
from nanovllm.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb
from nanovllm.platforms.cpu import CpuPlatform
from nanovllm.platforms.cpu.ops import NATIVE, inverse_cdf
from nanovllm.sampling.sampler import softmax_race

HOT_OPS = (rms_norm, add_rms_norm, silu_and_mul, apply_rotary_emb, softmax_race)


def norms(llm: LLM) -> list[RMSNorm]:
    return [m for m in llm.model_runner.model.modules() if isinstance(m, RMSNorm)]


def test_the_cpu_path_runs_the_native_twins(checkpoints):
    with LLM(str(checkpoints["gqa"]), device="cpu", num_kvcache_blocks=8) as llm:
        assert all(
            n._norm is NATIVE[rms_norm] and n._add_norm is NATIVE[add_rms_norm] for n in norms(llm)
        )
        assert all(
            m._fn is NATIVE[apply_rotary_emb]
            for m in llm.model_runner.model.modules()
            if isinstance(m, RotaryEmbedding)
        )
        assert llm.model_runner.sampler._draw is inverse_cdf  # the race's twin


@pytest.fixture
def compiled_on_cpu(monkeypatch) -> Counter:
    """Engines built meanwhile use compiled ops, compiled by a backend that counts its
    compilations and runs the traced graph as it is."""
    counts: Counter = Counter()

    def counting_backend(graph_module, example_inputs):
        counts["compilations"] += 1
        return graph_module.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn: real_compile(fn, backend=counting_backend))
    for op in HOT_OPS:
        monkeypatch.setattr(op, "_compiled", None)  # the fixture's, restored afterwards
    monkeypatch.setattr(CpuPlatform, "op_choice", lambda self: compiled_ops)
    torch._dynamo.reset()
    yield counts
    torch._dynamo.reset()


def compilations(path, counts: Counter) -> tuple[int, int]:
    """(compilations, distinct norm functions) for a run of prefill and decode batches."""
    torch._dynamo.reset()
    before = counts["compilations"]
    params = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True)
    with LLM(str(path), device="cpu", num_kvcache_blocks=32, kvcache_block_size=16) as llm:
        for batch in ([[5] * 9], [[5] * 30, [6] * 3, [7] * 17], [[8] * 4] * 5):
            llm.generate(batch, params, use_tqdm=False)
        functions = {id(n._norm) for n in norms(llm)} | {id(n._add_norm) for n in norms(llm)}
    return counts["compilations"] - before, len(functions)


@pytest.mark.slow
def test_one_compiled_function_serves_every_layer(compiled_on_cpu, tmp_path):
    one_layer = compilations(build_tiny_qwen3(tmp_path / "one", num_layers=1), compiled_on_cpu)
    six_layers = compilations(build_tiny_qwen3(tmp_path / "six", num_layers=6), compiled_on_cpu)
    assert one_layer[0] > 0  # the ops were compiled ...
    assert six_layers[0] == one_layer[0]  # ... as often for 6 layers x 4 norms as for 1
    assert six_layers[1] == 2  # every norm shares rms_norm's and add_rms_norm's twins
