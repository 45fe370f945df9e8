"""Weight formats chosen by `LLM(path, quantization=...)` (vLLM's argument), applied to a model
once its checkpoint is loaded, by the platform (platforms/cpu/): each linear layer is given a
WeightFormat (layers/linear.py) that its GEMM reads instead of the float weight; or checkpoints
published quantized, loaded as they are. Imported only when quantization is asked for, or the
checkpoint has it.

    int8   weight-only, per output channel, symmetric (int8.py)
    int4   weight-only, per output channel and group of 128 input channels, min-max (int4.py)
    gptq, awq   4-bit checkpoints with a quantization_config (published.py)
    gguf   llama.cpp's files (gguf_checkpoint.py)
"""

import os

from torch import nn


def quantize_model(model: nn.Module, method: str) -> int:
    """Quantize a loaded model's linear layers in place by `method` (Config checked it is one of
    config.QUANTIZATIONS); how many layers were."""
    if method == "int4":
        from nanovllm.quantization.int4 import quantize_int4

        return quantize_int4(model)
    assert method == "int8", method
    from nanovllm.quantization.int8 import quantize_int8

    return quantize_int8(model)


def load_published(model: nn.Module, folder: str, gguf_file: str | None, hf_config) -> int:
    """Load a checkpoint published quantized (GPTQ, AWQ, or the GGUF file `gguf_file` of
    `folder`); how many layers read 4-bit weights."""
    if gguf_file is not None:
        from nanovllm.quantization.gguf_checkpoint import load_gguf

        return load_gguf(model, os.path.join(folder, gguf_file), hf_config)
    from nanovllm.quantization.published import load_published

    return load_published(model, folder, hf_config)
