"""Qwen2 and Qwen2.5, as Hugging Face's Qwen2ForCausalLM: the shared decoder with biases
on q, k and v (not on o_proj) and no q/k norm."""

from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderFlags, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def flags(config: PretrainedConfig) -> DecoderFlags:
        return DecoderFlags(qkv_bias=True)
