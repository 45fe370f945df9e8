"""Platforms: what differs between devices, behind one interface (interface.py), so that the
model runner, the engine, the layers and the models never ask which device they are on. A run
imports one: the CPU's (cpu/) or CUDA's (cuda/)."""

import torch

from nanovllm.config import Config
from nanovllm.platforms.interface import Placement, Platform

__all__ = ["Placement", "Platform", "get_platform"]


def get_platform(config: Config, placement: Placement) -> Platform:
    """The platform of config.device; "auto": CUDA where PyTorch sees a GPU, else the CPU."""
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        from nanovllm.platforms.cuda import CudaPlatform

        return CudaPlatform(config, placement)
    from nanovllm.platforms.cpu import CpuPlatform

    return CpuPlatform(config, placement)
