"""Which device and dtype a runner uses, and host -> device copies that do not sync."""

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, gpu_index: int | None, gpus_needed: int) -> torch.device:
    """The CPU, or GPU number `gpu_index` of this machine's (None: the current one), of which
    `gpus_needed` must be visible."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is unavailable; use 'cpu' or 'auto'")
    if gpus_needed > torch.cuda.device_count():
        raise ValueError(
            f"{gpus_needed} GPUs are needed here (one per rank: tensor_parallel_size, or "
            f"torchrun's ranks per node) but {torch.cuda.device_count()} are visible; "
            "start fewer ranks or use device='cpu'"
        )
    return torch.device("cuda") if gpu_index is None else torch.device("cuda", gpu_index)


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(
            f"checkpoint dtype {name!r} is not supported; pass dtype= one of {', '.join(DTYPES)}"
        )
    return DTYPES[name]


def list_to_device(data: list, device: torch.device) -> torch.Tensor:
    """torch.tensor(data) on `device`, built through numpy, several times faster for a long
    list; floats become float32, as torch.tensor makes them."""
    array = np.array(data)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    return to_device(torch.from_numpy(array), device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """To CUDA through pinned memory, non_blocking: queued behind the device's work, where a
    copy from pageable memory would wait for everything queued before it."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
