"""`LoRARequest`, vLLM's name and fields (`from nanovllm.lora.request import LoRARequest`, as
`from vllm.lora.request import LoRARequest`): which adapter a request runs under. Pure Python;
the rest of lora/ is imported only with `enable_lora=True`."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str  # the adapter's name (the server's `model` field)
    lora_int_id: int  # its id, >= 1: the engine knows an adapter by it
    lora_path: str  # a PEFT checkpoint: adapter_config.json + adapter_model.safetensors

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise TypeError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise TypeError(f"lora_int_id must be an int, got {type(self.lora_int_id).__name__}")
        if self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}"
            )
        if not isinstance(self.lora_path, str):
            raise TypeError(f"lora_path must be a string, got {type(self.lora_path).__name__}")
