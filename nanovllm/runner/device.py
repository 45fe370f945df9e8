"""Which device and dtype a runner uses, and host -> device copies that do not make the
host wait for the device."""
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from nanovllm.config import checkpoint_dtype

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, rank: int = 0, world_size: int = 1) -> torch.device:
    """The device of `rank`: the CPU, or with tensor parallelism GPU number `rank`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available; use 'cpu' or 'auto'")
    if world_size == 1:
        return torch.device("cuda")
    if world_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={world_size} needs one GPU per rank but "
                         f"{torch.cuda.device_count()} are visible; lower it or use device='cpu'")
    return torch.device("cuda", rank)


def resolve_dtype(name: str, hf_config) -> torch.dtype:
    name = checkpoint_dtype(hf_config) if name == "auto" else name
    if name not in _DTYPES:
        raise ValueError(f"checkpoint dtype {name!r} is not supported; pass dtype= one of "
                         f"{', '.join(_DTYPES)}")
    return _DTYPES[name]


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside are `dtype` by default."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To CUDA it goes through pinned memory with
    non_blocking=True: the copy is queued behind the device's work and the host goes on,
    where a copy from pageable memory (or torch.tensor(data, device="cuda")) would wait
    for the device to finish everything queued before it."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
