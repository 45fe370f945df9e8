"""A Qwen3-0.6B-shaped checkpoint directory without weights, for the benchmarks:
Qwen/Qwen3-0.6B's config.json and a placeholder tokenizer (one word per id). nanovllm
runs it with load_format="dummy" (random weights), so nothing is downloaded."""
import json
import os

# Qwen/Qwen3-0.6B's config.json.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def write_dummy_checkpoint(path: str, config: dict = QWEN3_0_6B) -> str:
    """Write config.json and a placeholder tokenizer to `path`; returns `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    vocab = {f"<{i}>": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)
    return path
