"""nanovllm: a small, readable offline LLM inference engine. `LLM` is imported on first use,
so the torch-free control plane (`nanovllm.core`) imports without torch."""

from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from nanovllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
