"""Weight formats chosen by `LLM(path, quantization=...)` (vLLM's argument), applied to a model
once its checkpoint is loaded, by the platform (platforms/cpu/): each linear layer is given a
WeightFormat (layers/linear.py) that its GEMM reads instead of the float weight. Imported only
when quantization is asked for.

    int8   weight-only, per output channel, symmetric (int8.py)
    int4   weight-only, per output channel and group of 128 input channels, min-max (int4.py)
"""

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
