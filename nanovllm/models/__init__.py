"""Model definitions built from the data-plane layers: one shared decoder with a family's flags
(decoder.py), Qwen3-MoE's experts, the registry of architectures and checkpoint loading."""
