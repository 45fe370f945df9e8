"""config.json's `architectures[0]` -> the model class that implements it."""
from torch import nn
from transformers import PretrainedConfig

from nanovllm.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    name = architectures[0] if architectures else None
    if name not in MODELS:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(MODELS)}")
    return MODELS[name]
