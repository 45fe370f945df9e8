"""GGUF files (quantization/gguf_checkpoint.py): `LLM("model.gguf")` reads llama.cpp's file as
it is. The files are written here (tests/gguf_files.py) from random checkpoints of Qwen3's
layout and Llama's (Mistral's family: llama.cpp's converter permutes its q and k rows), with
the projections in Q4_K or Q4_0 (our int4 kernel reads them), F32, or a mix with Q8_0 (which is
dequantized at load). The oracle is transformers reading the same file (its GGUF loader
dequantizes with gguf-py): our prefill logits must be its, to float32 rounding, and our greedy
tokens its greedy tokens."""

import logging
import shutil

import pytest
import torch
from families import build_family_checkpoint, build_tokenizer_once
from test_quantization import (
    EXACT_TOLERANCE,
    assert_greedy_tokens_are,
    assert_two_ranks_decode_as_one,
    engine,
    make_prompts,
    prefill_logits,
)

from nanovllm import LLM, SamplingParams
from nanovllm.demo import build_tiny_qwen3

gguf = pytest.importorskip("gguf")
from gguf_files import Q, write_gguf  # noqa: E402

# Q4_K's blocks are 256 values of a row: every projection's inputs a multiple of 256.
SHAPE = dict(hidden_size=256, intermediate_size=512)
MIXED = "mixed"  # Q4_K, with v_proj, down_proj and the LM head in Q8_0 (as Q4_K_M has Q6_K)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_bases")
    tokenizer = build_tokenizer_once(root / "tokenizer")
    return {
        # head_dim 128, as every Qwen3's: transformers' GGUF reading assumes it for qwen3
        "qwen3": build_tiny_qwen3(root / "qwen3", head_dim=128, **SHAPE),
        "mistral": build_family_checkpoint(
            root / "mistral", "mistral", tokenizer, head_dim=64, **SHAPE
        ),
    }


@pytest.fixture(scope="module")
def files(bases, tmp_path_factory):
    """(family, type) -> the GGUF file, alone in a folder."""
    root = tmp_path_factory.mktemp("gguf_files")
    made = {}
    for family, base in bases.items():
        for kind in ("Q4_K", "Q4_0", "F32", MIXED):
            folder = root / f"{family}-{kind}"
            folder.mkdir()
            if kind == MIXED:
                types = dict(linear=Q.Q4_K, v_proj=Q.Q8_0, down_proj=Q.Q8_0, lm_head=Q.Q8_0)
            else:
                types = dict(linear=Q[kind])
            made[family, kind] = write_gguf(base, folder / "model.gguf", **types)
    return made


# MIXED's layers that our engine requantizes to int8 (a fused layer whole: q and k ride with v)
REQUANTIZED = ("q_proj", "k_proj", "v_proj", "down_proj", "lm_head")


def int8_in_float32(weight: torch.Tensor) -> torch.Tensor:
    """The int8 rule (per output row: scale = max |w| / 127, q = round(w / scale)) in float32, as
    the engine documents it: a requantized 4-bit value often lies on a rounding tie, where
    test_quantization's float64 statement of the rule may round the other way."""
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(weight / scale).clamp(-127, 127) * scale


def oracle(path):
    """transformers reading the file; for MIXED, the layers of a type without a kernel of ours
    requantized to int8 per output channel as the engine does (test_quantization's rule)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None
    if path.parent.name.endswith(MIXED):
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.endswith(REQUANTIZED):
                module.weight.data.copy_(int8_in_float32(module.weight.detach()))
    return model.eval()


def int4_layers(llm: LLM) -> int:
    from nanovllm.quantization.int4 import Int4Weight

    model = llm.model_runner.model
    return sum(isinstance(getattr(m, "weight_format", None), Int4Weight) for m in model.modules())


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0", "F32", MIXED])
def test_logits_are_transformers_reading_the_same_file(files, family, kind):
    path = files[family, kind]
    prompts = make_prompts()
    with engine(path) as llm:
        assert llm.config.quantization == "gguf"
        # per layer: q|k|v, o, gate|up, down; MIXED: v (in q|k|v) and down are not 4-bit
        assert int4_layers(llm) == {"F32": 0, MIXED: 2 * 2}.get(kind, 2 * 4)
        logits = prefill_logits(llm, prompts)
    model = oracle(path)
    expected = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(logits, expected, atol=EXACT_TOLERANCE, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_greedy_tokens_are_transformers_the_native_step_on_and_off(files, family):
    path = files[family, "Q4_K"]
    assert_greedy_tokens_are(oracle(path), path, make_prompts((9,), seed=5)[0])


def test_4_bit_layers_keep_their_types_form_and_the_files_exact_weights(bases, tmp_path):
    """Q4_0 runs as SYMMETRIC groups of 32 and Q4_K as SUB_SCALED groups of 256 (the kernel's
    forms, kernels/cpu_int4.py); a fused layer whose parts mix the two as AFFINE groups of 32.
    Each layer's weight is gguf-py's dequantization of its parts, bit for bit, and the logits
    are transformers'."""
    from gguf_files import dequantized_weights

    from nanovllm.kernels.cpu_int4 import Form

    path = tmp_path / "model.gguf"
    mixed = dict(linear=Q.Q4_K, k_proj=Q.Q4_0, gate_proj=Q.Q4_0, up_proj=Q.Q4_0)
    write_gguf(bases["qwen3"], path, **mixed)
    files = dequantized_weights(path)
    expected = {  # our layer -> (form, group size, its GGUF tensors)
        "self_attn.qkv_proj": (Form.AFFINE, 32, ("attn_q", "attn_k", "attn_v")),
        "self_attn.o_proj": (Form.SUB_SCALED, 256, ("attn_output",)),
        "mlp.gate_up_proj": (Form.SYMMETRIC, 32, ("ffn_gate", "ffn_up")),
        "mlp.down_proj": (Form.SUB_SCALED, 256, ("ffn_down",)),
    }
    prompts = make_prompts()
    with engine(path) as llm:
        model = llm.model_runner.model
        for i in range(len(model.model.layers)):
            for name, (form, group_size, parts) in expected.items():
                weight = model.get_submodule(f"model.layers.{i}.{name}").weight_format
                assert (weight.form, weight.group_size) == (form, group_size), name
                file = torch.cat([files[f"blk.{i}.{part}.weight"] for part in parts])
                assert torch.equal(weight.dequantize(), file), name
        logits = prefill_logits(llm, prompts)
    model = oracle(path)
    expected_logits = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(logits, expected_logits, atol=EXACT_TOLERANCE, rtol=0)


@pytest.mark.slow
def test_tensor_parallel_ranks_that_split_q4_k_groups_read_groups_of_32(tmp_path):
    """down_proj's 768 inputs over 2 ranks: 384 each, not whole groups of 256; those ranks read
    the layer as AFFINE groups of 32 (exact), and the tokens are one rank's."""
    base = build_tiny_qwen3(tmp_path / "base", head_dim=128, hidden_size=256, intermediate_size=768)
    path = write_gguf(base, tmp_path / "model.gguf", linear=Q.Q4_K)
    assert_two_ranks_decode_as_one(path)


def test_the_file_or_its_folder_and_the_files_tokenizer(files):
    path = files["qwen3", "Q4_K"]
    text = "def main():\n    return 42"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(path.parent), device="cpu", num_kvcache_blocks=32) as llm:
        by_folder = llm.generate([text], params, use_tqdm=False)[0]
        template = llm.tokenizer.chat_template
    with LLM(str(path), device="cpu", num_kvcache_blocks=32) as llm:
        by_file = llm.generate([text], params, use_tqdm=False)[0]
    assert by_file.outputs[0].token_ids == by_folder.outputs[0].token_ids
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert by_file.prompt_token_ids == tokenizer.encode(text)
    assert template and "<|im_start|>" in template  # the file's chat template


def test_a_type_without_a_kernel_is_requantized_to_int8_and_said_once(files, caplog):
    from nanovllm.quantization.int8 import Int8Weight

    with caplog.at_level(logging.INFO, logger="nanovllm"):
        with engine(files["qwen3", MIXED]) as llm:
            model = llm.model_runner.model
            int8 = [
                n
                for n, m in model.named_modules()
                if isinstance(getattr(m, "weight_format", None), Int8Weight)
            ]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF")]
    # q|k|v (its v is Q8_0) and down of 2 layers, and the LM head
    assert len(lines) == 1 and "4 Q4_K, 5 Q8_0 requantized to int8" in lines[0], lines
    assert sorted(int8) == sorted(
        [f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.qkv_proj", "mlp.down_proj")]
        + ["lm_head"]
    )


def test_bad_files_and_arguments_are_refused_by_name(files, tmp_path):
    path = files["qwen3", "Q4_0"]
    with pytest.raises(ValueError, match="quantization='int8' cannot apply"):
        LLM(str(path), device="cpu", quantization="int8")
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(path, two / "a.gguf")
    shutil.copy(path, two / "b.gguf")
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\)"):
        LLM(str(two), device="cpu")
    other = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(other), "falcon")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'falcon' is not supported"):
        LLM(str(other), device="cpu")
    with pytest.raises(ValueError, match="neither"):
        LLM(str(tmp_path / "absent.gguf"), device="cpu")


def test_nanovllm_serve_takes_a_gguf_file_or_its_folder(files, tmp_path):
    from nanovllm.entrypoints.cli import missing_model

    path = files["qwen3", "Q4_0"]
    assert missing_model(["serve", str(path)]) is None
    assert missing_model(["serve", str(path.parent)]) is None
    refused = missing_model(["serve", str(tmp_path / "absent.gguf")])
    assert refused is not None and "nor a GGUF file" in refused
