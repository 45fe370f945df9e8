"""A checkpoint's config.json read the same in both transformers styles (4: `torch_dtype`,
`rope_theta` + `rope_scaling`; 5: `dtype`, `rope_parameters`), and what of it our models can
run: checked by Config before any process is spawned or layer is built."""

from transformers import PretrainedConfig

# What tensor parallelism shards: attention heads, MLP columns (each expert's, in MoE),
# vocabulary rows.
_SHARDED_DIMS = (
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "vocab_size",
)


def checkpoint_dtype(hf_config: PretrainedConfig) -> str:
    """The checkpoint's dtype name."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


def rope_parameters(hf_config: PretrainedConfig) -> dict:
    """RoPE settings, with `rope_theta` and `rope_type` always present."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params.update(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def check_supported(hf_config: PretrainedConfig, tp_size: int, max_model_len: int) -> None:
    """Every sharded dimension splits evenly over tp_size ranks, and attention is full: a
    sliding window at least max_model_len wide never hides a key; a narrower one would."""
    dims = {name: getattr(hf_config, name, None) for name in _SHARDED_DIMS}
    dims = {name: value for name, value in dims.items() if isinstance(value, int)}
    for name, value in dims.items():
        if value % tp_size:
            fitting = [n for n in range(1, 9) if all(v % n == 0 for v in dims.values())]
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not divide the model's "
                f"{name} ({value}); this model can use tensor_parallel_size "
                f"{', '.join(map(str, fitting))}"
            )
    window = getattr(hf_config, "sliding_window", None)
    if (
        window is not None
        and getattr(hf_config, "use_sliding_window", True)
        and window < max_model_len
    ):
        raise ValueError(
            f"sliding_window ({window}) is smaller than max_model_len "
            f"({max_model_len}) and sliding-window attention is not supported; "
            f"pass max_model_len={window} or less"
        )
