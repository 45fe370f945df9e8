"""Qwen3-MoE, as Hugging Face's Qwen3MoeForCausalLM: Qwen3's decoder whose MLP is, in
the sparse layers, a router over num_experts SwiGLU experts of moe_intermediate_size
(models/moe.py). Layer i is sparse unless i is in mlp_only_layers or (i + 1) is not a
multiple of decoder_sparse_step; the other layers keep a dense MLP of intermediate_size."""

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.models.decoder import DecoderFlags
from nanovllm.models.moe import FusedMoE, expert_params_mapping
from nanovllm.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, router_logits=self.gate(hidden_states))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.expert_params_mapping = expert_params_mapping(config.num_experts)

    def make_mlp(self, config: PretrainedConfig, flags: DecoderFlags, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return Qwen3MoeSparseMoeBlock(config)
        return super().make_mlp(config, flags, layer_idx)


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )
