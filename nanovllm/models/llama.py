"""Llama 2 and 3.x, as Hugging Face's LlamaForCausalLM: the shared decoder with biases
where attention_bias (all four projections) and mlp_bias say. Llama 3.1's "llama3" RoPE
scaling is in rotary_embedding.py; Llama 3.2's tied embeddings in the shared head."""

from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderFlags, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    @staticmethod
    def flags(config: PretrainedConfig) -> DecoderFlags:
        bias = getattr(config, "attention_bias", False)
        return DecoderFlags(
            qkv_bias=bias, o_proj_bias=bias, mlp_bias=getattr(config, "mlp_bias", False)
        )
