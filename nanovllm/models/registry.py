"""config.json's `architectures[0]` -> the model class that implements it. Only the chosen
family's module is imported: a Qwen3 run never loads the MoE code."""

import importlib

from torch import nn
from transformers import PretrainedConfig

# architecture -> (module under nanovllm.models, class)
MODELS: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
}


def architecture(hf_config: PretrainedConfig) -> str:
    """The checkpoint's architecture name; a ValueError when no family here implements it."""
    architectures = getattr(hf_config, "architectures", None) or []
    name = architectures[0] if architectures else None
    if name not in MODELS:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(MODELS)}")
    return name


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    module, cls = MODELS[architecture(hf_config)]
    return getattr(importlib.import_module(f"nanovllm.models.{module}"), cls)
