"""Host -> device copies that do not make the host wait for the device."""
import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To CUDA it goes through pinned memory with
    non_blocking=True: the copy is queued behind the device's work and the host goes on,
    where a copy from pageable memory (or torch.tensor(data, device="cuda")) would wait
    for the device to finish everything queued before it."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
