"""config.json's `architectures[0]` -> the model class that implements it."""

from torch import nn
from transformers import PretrainedConfig

from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.mistral import MistralForCausalLM
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    name = architectures[0] if architectures else None
    if name not in MODELS:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(MODELS)}")
    return MODELS[name]
