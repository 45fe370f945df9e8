"""Shared fixtures: small random Qwen3 checkpoints built offline once per test run,
and Hugging Face `transformers` as the oracle for their output."""

import os
import shutil
from functools import cache
from pathlib import Path

import pytest

# The threads are fixed below; on a machine shared with other work, fixed threads that spin-wait
# for each other at every parallel region (libgomp's default) take the cores from the one with
# work: a test of 0.35 s alone took 27-50 s beside another test run, the subset of 59 engine tests
# in test_qwen3_parity, test_robustness, test_speculative and test_mixed_steps 18-40 s against
# 10-12 s waiting passively. Read when libgomp loads, so before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from nanovllm.platforms.cpu.threads import physical_cores  # noqa: E402

# The engine's CPU threads are given to the tests, as many as the engine would choose: a chosen
# count is governed (platforms/cpu/threads.py) and may change with the machine's load between two
# runs that a test compares bit for bit, where a reduction split over another number of threads
# rounds differently. tests/test_cpu_threads.py and test_cpu_thread_governor.py test the choice.
os.environ.setdefault("OMP_NUM_THREADS", str(physical_cores(os.sched_getaffinity(0))))

# name -> build_tiny_qwen3 arguments. Both GQA and MQA; tied and untied LM head;
# with and without attention bias; head_dim * heads != hidden_size in "mqa".
# "gqa" has the engine's fallback rope_theta (10000) and rms_norm_eps (1e-6); "mqa" has
# others (those of real Qwen3 and Llama checkpoints), so a field left unread fails there.
# A tied LM head scores the current token's own embedding high, so the tied model's
# layers are drawn wider than its embedding: its greedy output then varies instead of
# repeating one or two tokens.
MODEL_SHAPES = {
    "gqa": dict(num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False),
    "mqa": dict(
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        attention_bias=True,
        layer_initializer_range=0.24,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        seed=0,
    ),
}
# The engine's logits differ from transformers' by up to ~3e-6 on these checkpoints
# (float32, CPU); a greedy reference whose top token leads by less than 100 times that
# could be overturned by rounding, so hf_greedy refuses it.
MIN_TOP2_GAP = 3e-4
# The CPU kernels (kernels/cpu_*.cpp) build with the compiler kernels/cpu_build.py looks for.
HAS_COMPILER = bool(os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))


def native_library(load):
    """A CPU kernel's library, from its `load()`, for a test of it: skipped only where no
    C++ compiler exists; where one does, a build that fails fails the test."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler (g++ or c++, or $CXX) to build the CPU kernels")
    library = load()
    assert library is not None, "a CPU kernel did not build, with a compiler here (see its warning)"
    return library


def imported_modules(importtime_stderr: str) -> set[str]:
    """The modules a `python -X importtime ...` run imported, from its stderr: an entry point
    that answers a user's mistake before importing torch is checked with it."""
    lines = [x for x in importtime_stderr.splitlines() if x.startswith("import time:")]
    return {x.rsplit("|", 1)[1].strip() for x in lines[1:]}  # the first line is the header


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> checkpoint directory, including "gqa_v4": the gqa weights with a
    transformers-4 style config.json (rope_theta, torch_dtype) and a rope_theta that is
    not the engine's fallback."""
    from nanovllm.demo import build_tiny_qwen3

    root = tmp_path_factory.mktemp("checkpoints")
    paths = {name: build_tiny_qwen3(root / name, **kw) for name, kw in MODEL_SHAPES.items()}
    paths["gqa_v4"] = build_tiny_qwen3(
        root / "gqa_v4", config_style="transformers4", rope_theta=1e6, **MODEL_SHAPES["gqa"]
    )
    return paths


@pytest.fixture(scope="session")
def bos_checkpoint(checkpoints, tmp_path_factory) -> Path:
    """The gqa checkpoint with a tokenizer that puts <|endoftext|> first (a BOS, as Llama's
    does) whenever it adds special tokens."""
    import shutil

    from tokenizers import Tokenizer, processors

    path = tmp_path_factory.mktemp("bos") / "gqa_bos"
    shutil.copytree(checkpoints["gqa"], path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="session")
def thinking_checkpoint(checkpoints, tmp_path_factory) -> Path:
    """The gqa checkpoint thinking as Qwen3 does: <think> and </think> tokens and a chat
    template with Qwen3's enable_thinking switch (tests/thinking.py)."""
    from thinking import build_thinking_checkpoint

    return build_thinking_checkpoint(
        checkpoints["gqa"], tmp_path_factory.mktemp("thinking") / "gqa_thinking"
    )


@pytest.fixture(scope="session")
def wide_checkpoint(tmp_path_factory) -> Path:
    """A random checkpoint wider than the others (hidden 256, 4 layers), so that a few streams
    of a thousand tokens take the server seconds: the drain and fleet tests need requests in
    flight when a replica is signalled."""
    from nanovllm.demo import build_tiny_qwen3

    path = tmp_path_factory.mktemp("wide") / "wide"
    return build_tiny_qwen3(
        path, hidden_size=256, num_layers=4, intermediate_size=1024, head_dim=32
    )


@cache
def hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # No EOS for generate(): it runs the full length, as ignore_eos=True does on our side.
    # (min_new_tokens would instead mask EOS out of the argmax and change the tokens.)
    model.generation_config.eos_token_id = None
    return model


@cache
def hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, one prompt at a time (no padding); fails on a
    near-tie (see assert_clear_argmax)."""
    import torch

    out = hf_model(path).generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape[1] == len(prompt) + max_new_tokens
    assert_clear_argmax(
        torch.stack(out.logits)[:, 0],
        f"{Path(path).name}, prompt {list(prompt)[:8]}... ({len(prompt)} tokens)",
    )
    return out.sequences[0, len(prompt) :].tolist()


def assert_clear_argmax(logits, what: str) -> None:
    """Every greedy step's top logit leads the runner-up by MIN_TOP2_GAP: logits
    [steps, vocab], the scores each greedy token was the argmax of."""
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    step = int(gaps.argmin())
    assert gaps[step] >= MIN_TOP2_GAP, (
        f"near-tie in the greedy reference for {what}: at step {step} the top two logits "
        f"differ by {gaps[step].item():.1e} < MIN_TOP2_GAP = {MIN_TOP2_GAP:.0e}, so rounding "
        f"could flip the token and the comparison would be flaky; choose another prompt "
        f"(or checkpoint seed)"
    )


@pytest.fixture(scope="session")
def families(tmp_path_factory) -> dict[str, Path]:
    """name -> checkpoint directory, one per entry of tests/families.py's FAMILIES."""
    from families import FAMILIES, build_family_checkpoint, build_tokenizer_once

    root = tmp_path_factory.mktemp("families")
    tokenizer = build_tokenizer_once(root / "tokenizer")
    return {name: build_family_checkpoint(root / name, name, tokenizer) for name in FAMILIES}


@pytest.fixture(scope="session")
def server(bos_checkpoint):
    """One server for the server tests (tests/serving.py has the helpers), on the BOS
    checkpoint: completions add the BOS to text (as LLM.generate does) and chat's template is
    rendered without it (as LLM.chat does), so the two tokenize differently. Its body limit is
    16 MiB, so that a 12 MB prompt reaches the prompt-length check."""
    from serving import ENGINE, NAME, engine_flags, running_server

    flags = ["--served-model-name", NAME, "--max-request-bytes", str(16 * 2**20)]
    with running_server(bos_checkpoint, *flags, *engine_flags(**ENGINE)) as running:
        yield running
