"""Mistral, as Hugging Face's MistralForCausalLM: Llama's decoder without biases. Its
sliding window is not implemented: Config refuses one narrower than max_model_len (a
window at least that wide never hides a key, so attention is then exactly full)."""

from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderFlags, DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    @staticmethod
    def flags(config: PretrainedConfig) -> DecoderFlags:
        return DecoderFlags()
