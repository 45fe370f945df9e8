"""Checkpoints published quantized to 4 bits, loaded as they are: GPTQ and AWQ (the Hugging Face
hub's int4 checkpoints for vLLM's users). Their `quantization_config` (in config.json, or the
older quantize_config.json / quant_config.json beside it) names the method; Config reads it
(`quantization` is then "gptq" or "awq" without being asked) and the runner loads the weights
here instead of models/loader.py.

Both store, per linear layer `P` of K inputs and N outputs, groups of `group_size` inputs:

    GPTQ  P.qweight [K/8, N] int32   8 values of 4 bits along K in each (value j at bits 4j)
          P.qzeros  [G, N/8] int32   the zero points along N; format "gptq" (v1) stores zero - 1
          P.scales  [G, N]   float16
          P.g_idx   [K]      int32   each input's group (act-order permutes them: refused)
    AWQ   P.qweight [K, N/8] int32   8 values along N, in the order 0 2 4 6 1 3 5 7
          P.qzeros  [G, N/8] int32   the same packing
          P.scales  [G, N]   float16

and mean w[n, k] = scale[g, n] * (q[k, n] - zero[g, n]) for g = k // group_size. That is
quantization/int4.py's Int4Weight exactly: q, scale, and offset = -scale * zero, loaded by
loading.py. What is not quantized (embeddings, norms, and the LM head in most checkpoints) loads
as a float checkpoint's does.
"""

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.models.loader import check_names, checkpoint_tensors, expected_tensors
from nanovllm.quantization.loading import Int4Tensors, load_layers

METHODS = ("gptq", "awq")
PARTS = ("qweight", "qzeros", "scales", "g_idx")  # a quantized layer's tensors (AWQ: no g_idx)
# Older files beside config.json: AutoGPTQ's and AutoAWQ's.
CONFIG_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each 4-bit field of an int32 holds


@dataclass(frozen=True)
class Scheme:
    method: str  # "gptq" or "awq"
    group_size: int  # inputs a scale and zero point cover; -1: all of them (one group)
    zero_offset: int  # added to a stored zero point: 1 for GPTQ's v1 format, else 0


def find_quantization_config(model_dir: str, hf_config: object) -> dict | None:
    """The checkpoint's quantization config: config.json's, or an older file's; None."""
    config = getattr(hf_config, "quantization_config", None)
    if config is not None:
        return config if isinstance(config, dict) else config.to_dict()
    for name, method in CONFIG_FILES.items():
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                found = json.load(f)
            if not isinstance(found, dict):
                raise ValueError(f"{path} must hold a JSON object")
            return {"quant_method": method, **found}
    return None


def published_method(model: str, hf_config: object, asked: str | None) -> str:
    """`quantization` for a checkpoint that may be published quantized: its method, "gptq" or
    "awq"; a ValueError if `asked` is another, or asks for one the checkpoint is not."""
    config = find_quantization_config(model, hf_config)
    if config is None:
        raise ValueError(
            f"quantization={asked!r} needs a checkpoint published so (a GGUF file, or a "
            f"quantization_config in config.json); {model!r} is not"
        )
    method = read_scheme(config).method
    if asked not in (None, method):
        raise ValueError(
            f"the checkpoint is quantized with {method}; quantization={asked!r} cannot apply "
            f"(pass quantization={method!r} or none)"
        )
    return method


def read_scheme(config: dict) -> Scheme:
    """A quantization config as a Scheme; a ValueError names the field that is not supported."""
    method = str(config.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(
            f"quantization_config: quant_method {config.get('quant_method')!r} is not "
            f"supported; {', '.join(METHODS)} checkpoints are (4 bits)"
        )
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config: {method} with bits={bits!r}; only 4 is supported")
    group_size = config.get("group_size", config.get("q_group_size", 128))
    if not isinstance(group_size, int) or (group_size != -1 and group_size % 32):
        raise ValueError(
            f"quantization_config: group_size {group_size!r} must be -1 or a multiple of 32"
        )
    if method == "gptq":
        if config.get("desc_act") and not config.get("static_groups"):
            raise ValueError(
                "quantization_config: GPTQ with desc_act=true (act-order) permutes the groups "
                "across the inputs (g_idx), which is not supported; a desc_act=false checkpoint is"
            )
        checkpoint_format = config.get("checkpoint_format", config.get("format", "gptq"))
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"quantization_config: GPTQ checkpoint_format {checkpoint_format!r} is not "
                "supported; gptq (v1) and gptq_v2 are"
            )
        return Scheme(method, group_size, zero_offset=1 if checkpoint_format == "gptq" else 0)
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm" or config.get("zero_point", True) is not True:
        raise ValueError(
            f"quantization_config: AWQ version {version!r}, zero_point "
            f"{config.get('zero_point', True)!r}; the GEMM packing with zero points is supported"
        )
    return Scheme(method, group_size, zero_offset=0)


# -- one layer's tensors into int4.py's (q, scale, offset) ------------------------------------


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 of 8 fields each along R -> [8R, C] uint8: field j of row r is row 8r + j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    fields = (packed.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF
    return fields.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[R, C] int32 of 8 fields each along C -> [R, 8C] uint8: field i of column c is column
    8c + order[i]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    fields = (packed.unsqueeze(2) >> shifts.view(1, 1, 8)) & 0xF
    columns = torch.empty_like(fields)
    columns[:, :, list(order)] = fields
    return columns.reshape(packed.shape[0], -1).to(torch.uint8)


def unpack(tensors: dict[str, torch.Tensor], scheme: Scheme, name: str) -> Int4Tensors:
    """One layer's 4-bit values with their scales and offsets (loading.py)."""
    scales = tensors["scales"].float()
    if scheme.method == "gptq":
        q = unpack_rows(tensors["qweight"])  # [K, N]
        zeros = unpack_columns(tensors["qzeros"], tuple(range(8)))
    else:
        q = unpack_columns(tensors["qweight"], AWQ_ORDER)  # [K, N]
        zeros = unpack_columns(tensors["qzeros"], AWQ_ORDER)
    in_features, out_features = q.shape
    group_size = in_features if scheme.group_size == -1 else scheme.group_size
    groups = in_features // group_size
    if in_features % group_size or scales.shape != (groups, out_features):
        raise ValueError(
            f"{name}: scales {tuple(scales.shape)} do not fit {in_features} inputs in groups "
            f"of {group_size} and {out_features} outputs"
        )
    zeros = zeros[:, :out_features].float() + scheme.zero_offset
    if zeros.shape != scales.shape:
        raise ValueError(f"{name}: qzeros {tuple(zeros.shape)} do not match scales")
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        sequential = torch.arange(in_features) // group_size
        if not torch.equal(g_idx.long(), sequential):
            raise ValueError(
                f"{name}: g_idx is not the inputs' groups in order (act-order), not supported"
            )
    offset = -scales * zeros
    return Int4Tensors(
        q.t().contiguous(), scales.t().contiguous(), offset.t().contiguous(), group_size
    )


# -- the model's weights ----------------------------------------------------------------------


def load_published(model: nn.Module, path: str, hf_config: object) -> int:
    """Load a GPTQ / AWQ checkpoint into `model` (loading.py); how many layers read 4 bits."""
    scheme = read_scheme(find_quantization_config(path, hf_config))
    expected = expected_tensors(model, dict(model.named_parameters()))
    found = checkpoint_tensors(path)
    layers = {name.removesuffix(".qweight") for name in found if name.endswith(".qweight")}
    plain = {name: file for name, file in found.items() if name.rpartition(".")[0] not in layers}
    check_names(model, path, expected, plain | {f"{layer}.weight": "" for layer in layers})

    def read(name: str) -> torch.Tensor | Int4Tensors:
        layer = name.removesuffix(".weight")
        if layer not in layers:
            return _read(found, name)
        parts = {p: _read(found, f"{layer}.{p}") for p in PARTS if f"{layer}.{p}" in found}
        return unpack(parts, scheme, layer)

    return load_layers(model, expected, read)


def _read(found: dict[str, str], name: str) -> torch.Tensor:
    with safe_open(found[name], framework="pt", device="cpu") as f:
        return f.get_tensor(name)
