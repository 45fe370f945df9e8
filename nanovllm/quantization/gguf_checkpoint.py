"""GGUF files, llama.cpp's checkpoints: `LLM("model.gguf")`, or a folder holding one .gguf and no
config.json. The file has it all: the architecture and hyper-parameters (read through
transformers' GGUF support, as vLLM does), the tokenizer (idem), and the tensors, named by
llama.cpp (`blk.3.attn_q.weight`: gguf-py's name map turns our names into those). The `gguf`
package reads the file (pip install 'nano-vllm[gguf]'); the kernels are ours:

    Q4_0   blocks of 32: a float16 d and 16 bytes of 4-bit q     w = d * q - 8 d
    Q4_K   blocks of 256: float16 d and dmin, 8 sub-blocks of 32 with 6-bit scales sc and
           mins m, 128 bytes of 4-bit q                          w = d sc * q - dmin m

run in their own granularity, never dequantized, in the int4 kernel's forms (kernels/cpu_int4.py):
Q4_0 as SYMMETRIC groups of 32 (scale d, stored in float16; offset -8 d, not stored: 0.5625
bytes a weight, as the file's), Q4_K as SUB_SCALED groups of 256 (scale d, offset -dmin, and per
32 inputs the integers sc and m: 0.59 bytes a weight, the float work once per 256 inputs). Each
value is the file's, so the weights are ggml's dequantized ones, exactly. A fused layer whose
parts mix the two types reads both as AFFINE groups of 32 (scale d and offset -8 d; d sc and
-dmin m: products exact in float32), as does a Q4_K layer whose groups of 256 tensor parallelism
splits (loading.py). loading.py passes the 4-bit values through each layer's
weight loader and packs them for the kernel; a layer whose parts are all of these types runs the
int4 kernel. F32, F16 and BF16 tensors load as they are. A linear layer of every other type (Q8_0,
Q6_K, ...: some v and down projections of a Q4_K_M file), or whose fused parts mix types, is
dequantized by gguf-py and requantized to int8 per output channel (quantization/int8.py: a byte a
weight, its values within half an int8 step of the file's), one line saying so; so is an LM head
tied to a quantized token embedding (the embedding's lookups keep a float32 copy). llama.cpp's
converter permutes Llama's (and Mistral's) q and k rows for its rotary layout: they are permuted
back, rows of 4-bit values as rows of floats.
"""

import logging
import os
from collections import Counter

import gguf
import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from nanovllm.kernels.cpu_int4 import Form
from nanovllm.layers.linear import FormattedWeight
from nanovllm.models.loader import expected_tensors
from nanovllm.quantization.loading import Int4Tensors, load_layers

Q = gguf.GGMLQuantizationType
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
INT4_TYPES = (Q.Q4_0, Q.Q4_K)
# general.architecture -> our model class (models/registry.py's names)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}  # not qwen3moe yet: its experts are 3-D tensors, one per projection
PERMUTED = ("llama",)  # llama.cpp's converter interleaves these architectures' q and k rows


def gguf_config(folder: str, file: str, quantization: str | None) -> PretrainedConfig:
    """The model's config from the file's metadata: transformers' reading, with what it leaves
    out (the model class, head_dim, whether the LM head is the embedding) from the file.
    `quantization` must be None or "gguf": the weights are as the file has them."""
    if quantization not in (None, "gguf"):
        raise ValueError(
            f"a GGUF file's weights are quantized as the file has them; quantization="
            f"{quantization!r} cannot apply (pass quantization='gguf' or none)"
        )
    reader = gguf.GGUFReader(os.path.join(folder, file))
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF {file!r}: architecture {arch!r} is not supported; {', '.join(ARCHITECTURES)} are"
        )
    names = {t.name for t in reader.tensors}
    overrides = dict(
        architectures=[ARCHITECTURES[arch]], tie_word_embeddings="output.weight" not in names
    )
    head_dim = _field(reader, f"{arch}.attention.key_length", None)
    if head_dim is not None:
        overrides["head_dim"] = int(head_dim)
    return AutoConfig.from_pretrained(folder, gguf_file=file, **overrides)


def load_gguf(model: nn.Module, path: str, hf_config: PretrainedConfig) -> int:
    """Load a GGUF file into `model`; how many layers read 4 bits."""
    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    name_map = gguf.get_tensor_name_map(arch_id, hf_config.num_hidden_layers)
    params = dict(model.named_parameters())
    expected = expected_tensors(model, params)
    ours = {name: name_map.get_name(name, try_suffixes=(".weight", ".bias")) for name in expected}
    tensors = {t.name: t for t in reader.tensors}
    _check_names(path, ours, tensors)
    int4 = _int4_parameters(model, expected, ours, tensors)
    int8: set[str] = set()  # linear weights of the other quantized types
    kinds: Counter[str] = Counter()

    def read(name: str) -> torch.Tensor | Int4Tensors:
        tensor, param_name = tensors[ours[name]], expected[name][0]
        heads = _permuted_heads(arch, name, hf_config)
        if param_name in int4:
            value = unpack(tensor, native=int4[param_name])
            if heads:
                value = value._replace(
                    **{f: _unpermute(getattr(value, f), heads) for f in _ROW_FIELDS[value.form]}
                )
            return value
        if tensor.tensor_type not in FLOAT_TYPES and _is_linear(model, param_name):
            int8.add(param_name)
            kinds[tensor.tensor_type.name] += 1
        weight = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type)))
        weight = weight.float().reshape(_shape(tensor))
        return _unpermute(weight, heads) if heads else weight

    count = load_layers(model, expected, read)
    head = _tied_quantized_head(model, tensors)
    if int8 or head is not None:
        _requantize_int8(model, int8, head)
        what = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        if head is not None:
            what += f"{', ' if what else ''}the LM head (the {head} token_embd it shares)"
        logging.getLogger("nanovllm").info(
            "GGUF: %s requantized to int8 per output channel (no kernel of ours reads their type)",
            what,
        )
    return count


def _tied_quantized_head(model: nn.Module, tensors: dict) -> str | None:
    """The type of the token embedding an LM head shares, if it is quantized: the head then
    reads int8 rather than the float copy the lookups need."""
    embedding = tensors.get("token_embd.weight")
    if "output.weight" in tensors or embedding is None or embedding.tensor_type in FLOAT_TYPES:
        return None
    return embedding.tensor_type.name


def _requantize_int8(model: nn.Module, params: set[str], head: str | None) -> None:
    """The layers whose GGUF type has no kernel of ours (Q8_0, Q6_K, ...), dequantized at load,
    read int8 weights per output channel (quantization/int8.py), as does a head tied to a
    quantized embedding (its own copy: the lookups keep the float one)."""
    from nanovllm.quantization.int8 import Int8Weight

    for name in sorted(params):
        module = model.get_submodule(name.rpartition(".")[0])
        module.set_weight_format(Int8Weight(module.weight.detach()), keep_weight=False)
    if head is not None:
        lm_head = model.get_submodule("lm_head")
        lm_head.set_weight_format(Int8Weight(lm_head.weight.detach()), keep_weight=True)


# -- Q4_0 and Q4_K into int4.py's format --------------------------------------------------------


_ROW_FIELDS = {  # an Int4Tensors' tensors, each a row per output channel
    Form.AFFINE: ("q", "scale", "offset"),
    Form.SYMMETRIC: ("q", "scale", "offset"),
    Form.SUB_SCALED: ("q", "scale", "offset", "sub_scale", "sub_offset"),
}


def unpack(tensor: gguf.ReaderTensor, native: bool = True) -> Int4Tensors:
    """A Q4_0 or Q4_K tensor's 4-bit values with their scales: in the type's own form if
    `native`, else AFFINE groups of 32 (a fused layer whose parts mix the two types)."""
    rows = int(tensor.shape[1]) if len(tensor.shape) > 1 else 1
    data = np.asarray(tensor.data).reshape(rows, -1)

    def as_tensor(a: np.ndarray, dtype=np.float32) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1), dtype=dtype))

    if tensor.tensor_type == Q.Q4_0:
        blocks = data.reshape(rows, -1, 18)
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
        qs = blocks[..., 2:]
        q = as_tensor(np.concatenate([qs & 0xF, qs >> 4], axis=-1), np.uint8)  # 0-15, 16-31
        form = Form.SYMMETRIC if native else Form.AFFINE
        return Int4Tensors(q, as_tensor(d), as_tensor(-8 * d), 32, form)
    blocks = data.reshape(rows, -1, 144)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = _scales_and_mins(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # 64-value chunks of 32 bytes
    q = as_tensor(np.concatenate([qs & 0xF, qs >> 4], axis=3), np.uint8)  # a chunk's two halves
    if not native:
        return Int4Tensors(q, as_tensor(d * sc), as_tensor(-(dmin * m)), 32)
    sub_scale, sub_offset = as_tensor(sc, np.uint8), as_tensor(m, np.uint8)
    return Int4Tensors(
        q, as_tensor(d), as_tensor(-dmin), 256, Form.SUB_SCALED, sub_scale, sub_offset
    )


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K block's 12 bytes -> its 8 sub-blocks' 6-bit scales and mins (float32, exact): ggml's
    get_scale_min_k4: bytes 0-3 and 4-7 hold sub-blocks 0-3 in their low 6 bits and 4-7's top
    2 bits above them; bytes 8-11 hold 4-7's low 4 bits of scale and of min."""
    low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 63, (rest & 0xF) | ((low >> 6) << 4)], axis=-1)
    m = np.concatenate([high & 63, (rest >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


# -- helpers ----------------------------------------------------------------------------------


def _field(reader: gguf.GGUFReader, key: str, *default):
    field = reader.fields.get(key)
    if field is None:
        if default:
            return default[0]
        raise ValueError(f"GGUF file lacks the field {key!r}")
    return field.contents()


def _check_names(path: str, ours: dict[str, str | None], tensors: dict) -> None:
    problems = []
    if unnamed := sorted(name for name, gguf_name in ours.items() if gguf_name is None):
        problems.append(f"no GGUF name for {', '.join(unnamed)}")
    if missing := sorted(g for g in ours.values() if g is not None and g not in tensors):
        problems.append(f"GGUF {path!r} lacks tensor(s): {', '.join(missing)}")
    if extra := sorted(set(tensors) - set(ours.values()) - {"rope_freqs.weight"}):
        problems.append(f"GGUF tensor(s) {', '.join(extra)} match no parameter")
    if problems:
        raise ValueError("\n".join(problems))


def _int4_parameters(model: nn.Module, expected: dict, ours: dict, tensors: dict) -> dict:
    """The linear weights whose every part (q, k and v of q|k|v...) is Q4_0 or Q4_K, each with
    whether its parts are of one type (then read in that type's form)."""
    kinds: dict[str, set] = {}
    for name, (param_name, _) in expected.items():
        kinds.setdefault(param_name, set()).add(tensors[ours[name]].tensor_type)
    int4 = set(INT4_TYPES)
    return {
        name: len(types) == 1
        for name, types in kinds.items()
        if types <= int4 and _is_linear(model, name)
    }


def _is_linear(model: nn.Module, param_name: str) -> bool:
    """A linear layer's weight, the LM head's too (not a bias, an embedding's or a norm's)."""
    module = model.get_submodule(param_name.rpartition(".")[0])
    return param_name.endswith(".weight") and isinstance(module, FormattedWeight)


def _shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """The tensor's shape, rows first (GGUF lists its dimensions innermost first)."""
    return tuple(int(n) for n in reversed(tensor.shape))


def _permuted_heads(arch: str, name: str, hf_config: PretrainedConfig) -> int:
    """The heads whose q or k rows llama.cpp's converter interleaved; 0 if none."""
    if arch not in PERMUTED or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return 0
    if "q_proj" in name:
        return hf_config.num_attention_heads
    return hf_config.num_key_value_heads


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo the converter's permutation: in each head, rows (h, i, half) back to (h, half, i)."""
    shape = rows.shape
    return rows.reshape(heads, -1, 2, *shape[1:]).transpose(1, 2).reshape(shape).contiguous()
