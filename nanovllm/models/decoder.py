"""The dense decoder shared by Qwen3, Qwen2, Llama and Mistral (and Qwen3-MoE's layers).

    embed_tokens -> N x [RMSNorm -> attention -> RMSNorm -> MLP] -> RMSNorm -> lm_head

with RoPE on q and k, grouped-query attention over the paged KV cache, a SwiGLU MLP and
an optionally tied LM head. The families differ only where DecoderFlags says:

              q/k norm   q/k/v bias        o_proj bias       MLP bias
    Qwen3     yes        attention_bias    attention_bias    no
    Qwen2     no         yes               no                no
    Llama     no         attention_bias    attention_bias    mlp_bias
    Mistral   no         no                no                no

A family is a subclass of DecoderForCausalLM that says its flags (and, for MoE, which
layers get which MLP). Options none of them implements are refused by name with the
engine's Config (config.py's check_model_config), before any weight is loaded.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import get_rope
from nanovllm.models.hf_config import rope_parameters


@dataclass(frozen=True, slots=True)
class DecoderFlags:
    qk_norm: bool = False  # RMSNorm over each head's q and k, before RoPE (Qwen3)
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, flags: DecoderFlags):
        super().__init__()
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=flags.qkv_bias,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=flags.o_proj_bias
        )
        if flags.qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.qk_norm = flags.qk_norm
        self.rotary_emb = get_rope(
            head_dim, config.max_position_embeddings, rope_parameters(config)
        )
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(out.flatten(1))


class DecoderMLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)), gate and up in one matrix."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, flags: DecoderFlags, mlp: nn.Module):
        super().__init__()
        self.self_attn = DecoderAttention(config, flags)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, flags: DecoderFlags, mlps: list[nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, flags, mlp) for mlp in mlps)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """The model classes of the registry derive from this one and define flags()."""

    # checkpoint tensor -> (our packed parameter, its shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        flags = self.flags(config)
        mlps = [self.make_mlp(config, flags, i) for i in range(config.num_hidden_layers)]
        self.model = DecoderModel(config, flags, mlps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one parameter, two uses

    @staticmethod
    def flags(config: PretrainedConfig) -> DecoderFlags:
        raise NotImplementedError

    def make_mlp(self, config: PretrainedConfig, flags: DecoderFlags, layer_idx: int) -> nn.Module:
        return DecoderMLP(config.hidden_size, config.intermediate_size, flags.mlp_bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)
