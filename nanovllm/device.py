"""dtype names, and host -> device copies that do not sync."""

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    """A host tensor on `device`: through pinned memory, non_blocking, so the copy is queued
    behind the device's work where one from pageable memory would wait for all of it. A tensor
    already there (a CPU run's) is returned as it is."""
    if tensor.device == device:
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
