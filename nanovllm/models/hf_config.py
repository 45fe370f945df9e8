"""A checkpoint's config.json read the same in both transformers styles (4: `torch_dtype`,
`rope_theta` + `rope_scaling`; 5: `dtype`, `rope_parameters`). What of it our models can run
is checked beside Config (config.py's check_model_config)."""

from transformers import PretrainedConfig


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
