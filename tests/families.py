"""Tiny random checkpoints of each model family, built offline with transformers' own
classes and written as published checkpoints are: config.json in the transformers-4 style
(rope_theta, rope_scaling, torch_dtype), the larger ones sharded over several
safetensors files with model.safetensors.index.json.

rope_theta and rms_norm_eps differ from every family's default, so a model that ignored
either would not match. initializer_range is large so logits are peaked and greedy
decoding does not hinge on near-ties; norms and biases are perturbed away from 1 and 0 so
a missing one is caught.
"""

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROPE_THETA = 3000.0
RMS_NORM_EPS = 1e-3
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.08,
    rms_norm_eps=RMS_NORM_EPS,
)


@dataclass(frozen=True)
class Family:
    config_class: str  # transformers' classes, by name
    model_class: str
    config: dict  # arguments beyond SHAPE
    rope_scaling: dict | None = None
    max_shard_size: str = "50GB"  # smaller: several files and an index
    published: dict = field(default_factory=dict)  # config.json keys as real checkpoints write them


FAMILIES = {
    # Qwen2.5 checkpoints carry a sliding_window that use_sliding_window=false turns off.
    "qwen2": Family(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(tie_word_embeddings=False),
        published=dict(sliding_window=32, use_sliding_window=False),
    ),
    # Llama 3.2: llama3 RoPE scaling (positions past 32 are "long"), tied embeddings.
    "llama": Family(
        "LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True), rope_scaling=LLAMA3_ROPE
    ),
    # Llama-2-style plain RoPE, with every bias Llama's config can ask for.
    "llama_bias": Family(
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    ),
    # Mistral 7B v0.1's window, wider than this model's 1024 positions: full attention.
    "mistral": Family(
        "MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=4096)
    ),
    # Qwen3-30B-A3B's layout in small: layer 1 is dense (mlp_only_layers), 0 and 2 sparse.
    "qwen3_moe": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
        max_shard_size="150KB",
    ),
}


def build_tokenizer_once(path: Path) -> Path:
    from nanovllm.demo import build_tokenizer

    build_tokenizer(path)
    return path


def build_family_checkpoint(
    path: Path, name: str, tokenizer_dir: Path, seed: int = 0, **shape
) -> Path:
    """`shape`: SHAPE's fields to change (hidden_size, ...)."""
    import transformers

    family = FAMILIES[name]
    path.mkdir(parents=True)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, path / file.name)
    rope = {"rope_type": "default", **(family.rope_scaling or {}), "rope_theta": ROPE_THETA}
    config = getattr(transformers, family.config_class)(
        **SHAPE | family.config | shape,
        vocab_size=_vocab_size(path),
        eos_token_id=_eos_token_id(path),
        bos_token_id=None,
        pad_token_id=None,
        rope_parameters=rope,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(config).float()
    _randomize(model, config.initializer_range)
    model.save_pretrained(str(path), max_shard_size=family.max_shard_size)
    rewrite_as_transformers4(path / "config.json", family.rope_scaling, family.published)
    return path


@torch.no_grad()
def _randomize(model: torch.nn.Module, std: float) -> None:
    for param_name, param in model.named_parameters():
        if param_name.endswith("norm.weight"):
            param.copy_(1 + 0.2 * torch.randn_like(param))
        elif param_name.endswith("bias"):
            param.copy_(0.05 * torch.randn_like(param))
        elif param_name.endswith("mlp.gate.weight"):  # the router: decisive top-k choices
            param.normal_(0.0, 0.5)
        else:
            param.normal_(0.0, std)


def rewrite_as_transformers4(config_path: Path, rope_scaling: dict | None, published: dict) -> None:
    config = json.loads(config_path.read_text()) | published
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["rope_theta"]
    config["rope_scaling"] = rope_scaling
    config["torch_dtype"] = str(config.pop("dtype", "float32"))
    if "num_local_experts" in config:  # Qwen3-MoE's published key
        config["num_experts"] = config.pop("num_local_experts")
    config["transformers_version"] = "4.51.0"
    config_path.write_text(json.dumps(config, indent=2))


def edit_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of checkpoint `src` with config.json keys changed."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | changes, indent=2))
    return dst


def _vocab(path: Path) -> dict:
    return json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]


def _vocab_size(path: Path) -> int:
    return len(_vocab(path))


def _eos_token_id(path: Path) -> int:
    return _vocab(path)["<|im_end|>"]
