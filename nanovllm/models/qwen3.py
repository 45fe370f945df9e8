"""Qwen3 (dense), as Hugging Face's Qwen3ForCausalLM: the shared decoder with an RMSNorm
over each head's q and k before RoPE, and biases where attention_bias says."""

from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderFlags, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def flags(config: PretrainedConfig) -> DecoderFlags:
        bias = getattr(config, "attention_bias", False)
        return DecoderFlags(qk_norm=True, qkv_bias=bias, o_proj_bias=bias)
