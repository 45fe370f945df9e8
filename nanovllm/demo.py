"""Checkpoints built offline, so nothing is downloaded:

- tiny random Qwen3 checkpoints, for `example.py` when no real model is present and for
  the tests (which compare them with Hugging Face `transformers`): config.json,
  model.safetensors, generation_config.json and a byte-level BPE tokenizer trained in
  about a second on the Python standard library's own sources. Their text is noise.
- weightless checkpoints (config.json + a placeholder tokenizer) of a real shape such as
  Qwen3-0.6B, for benchmarks that run `load_format="dummy"` (random weights).

The demo checkpoint carries a marker file, so the server can tell a user it is serving noise;
DOWNLOAD_COMMAND is what the entry points tell a user to run for the real model instead.
"""

import json
import os
import shutil
import sysconfig
from pathlib import Path

# v2: the first with DEMO_MARKER (a v1 directory, built before it, is left as it is).
DEMO_DIR = Path(os.path.expanduser("~/.cache/nanovllm/qwen3-tiny-demo-v2"))
DEMO_MARKER = "NANOVLLM_RANDOM_DEMO"
# The real model the demo stands in for. `hf` is huggingface_hub's command since 0.34 (1.0 removed
# `huggingface-cli`); tests/test_example.py checks that it is installed and takes these options.
DOWNLOAD_COMMAND = "hf download Qwen/Qwen3-0.6B --local-dir ~/huggingface/Qwen3-0.6B/"
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS_FILES = ("argparse.py", "textwrap.py", "random.py", "string.py", "os.py", "dataclasses.py")

# Qwen/Qwen3-0.6B's config.json.
QWEN3_0_6B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def build_tokenizer(path: str | Path, vocab_size: int = 512) -> int:
    """Train and save a byte-level BPE tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in _CORPUS_FILES]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=_CHAT_TEMPLATE,
    )
    wrapped.save_pretrained(str(path))
    return tokenizer.get_vocab_size()


def write_weightless_checkpoint(path: str | Path, config: dict = QWEN3_0_6B_CONFIG) -> Path:
    """config.json and a placeholder tokenizer (one word per id, "<17>") in `path`: enough
    for `LLM(path, load_format="dummy")` and for peers that load a tokenizer; feed it
    token ids, not text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    vocab = {f"<{i}>": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(str(path))
    return path


def build_tiny_qwen3(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    max_position_embeddings: int = 1024,
    initializer_range: float = 0.08,
    layer_initializer_range: float | None = None,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    config_style: str = "transformers5",
    seed: int = 0,
) -> Path:
    """Write a random Qwen3 checkpoint with a tokenizer to `path` and return it.

    Weight matrices are N(0, initializer_range); `layer_initializer_range`, if given, is
    the decoder layers' own. The logits are nearly flat (at the defaults the top token's
    probability is 0.01-0.03 and the top two logits can lie within 1e-4 of each other), so
    a test comparing greedy tokens should check that its reference has no near-ties. With
    a tied LM head the current token's own embedding dominates its logits and greedy
    decoding repeats one or two tokens; layers drawn wider than the embedding (e.g. 0.24
    against 0.08) outweigh it and the output varies. Norm weights are perturbed (a missing
    norm is caught). `config_style="transformers4"`: rope_theta/torch_dtype, as real Qwen3's."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(path)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=attention_bias,
        rope_theta=rope_theta,
        rms_norm_eps=rms_norm_eps,
        eos_token_id=_eos_token_id(path),
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    _perturb(model, layer_initializer_range)
    model.save_pretrained(str(path), safe_serialization=True)
    if config_style == "transformers4":
        _rewrite_as_transformers4(path / "config.json")
    return path


def _perturb(model, layer_initializer_range: float | None) -> None:
    """Norms away from 1, biases away from 0, decoder layers optionally drawn wider."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.05 * torch.randn_like(param))
            elif layer_initializer_range is not None and ".layers." in name:
                param.normal_(0.0, layer_initializer_range)


def _eos_token_id(path: Path) -> int:
    """The id of the tokenizer's EOS token (<|im_end|>)."""
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    return vocab["<|im_end|>"]


def _rewrite_as_transformers4(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    rope = config.pop("rope_parameters", None) or {}
    config["rope_theta"] = rope.get("rope_theta", 10000.0)
    config["rope_scaling"] = None
    config["torch_dtype"] = str(config.pop("dtype", "float32"))
    config["transformers_version"] = "4.51.0"
    config_path.write_text(json.dumps(config, indent=2))


def demo_checkpoint() -> Path:
    """The demo checkpoint, built once under ~/.cache/nanovllm/."""
    if not (DEMO_DIR / "model.safetensors").is_file():
        # Built aside and renamed into place, so an interrupted build leaves no half checkpoint.
        tmp = DEMO_DIR.with_name(f"{DEMO_DIR.name}.tmp{os.getpid()}")
        build_tiny_qwen3(tmp, config_style="transformers4")
        (tmp / DEMO_MARKER).write_text(
            "nanovllm's tiny demo checkpoint (nanovllm/demo.py): random weights, its text is "
            f"noise. For a real model: {DOWNLOAD_COMMAND}\n"
        )
        try:
            tmp.rename(DEMO_DIR)
        except OSError:  # another process finished first
            shutil.rmtree(tmp)
    return DEMO_DIR


def is_demo_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a demo checkpoint (random weights), by its marker file."""
    return (Path(os.path.expanduser(path)) / DEMO_MARKER).is_file()
