"""What tensor parallelism shards, checked with the engine's Config before any rank is spawned:
each sharded dimension must split evenly over the ranks."""

from transformers import PretrainedConfig

# What tensor parallelism shards: attention heads, MLP columns (each expert's, in MoE),
# vocabulary rows.
SHARDED_DIMS = (
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "vocab_size",
)


def check_sharding(hf_config: PretrainedConfig, tp_size: int) -> None:
    """Every sharded dimension splits evenly over tp_size ranks."""
    dims = {name: getattr(hf_config, name, None) for name in SHARDED_DIMS}
    dims = {name: value for name, value in dims.items() if isinstance(value, int)}
    for name, value in dims.items():
        if value % tp_size:
            fitting = [n for n in range(1, 9) if all(v % n == 0 for v in dims.values())]
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not divide the model's "
                f"{name} ({value}); this model can use tensor_parallel_size "
                f"{', '.join(map(str, fitting))}"
            )
