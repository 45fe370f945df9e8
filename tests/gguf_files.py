"""GGUF files written here from the small random checkpoints, as llama.cpp's converter and
llama-quantize lay them out: its tensor names (gguf-py's name map), Llama's q and k rows
permuted for its rotary layout, the hyper-parameters and the byte-level BPE tokenizer as
metadata, and the linear weights in a chosen type: Q4_0 and Q8_0 by gguf-py's own quantizer,
Q4_K packed here from ggml's block layout (gguf-py reads it but does not write it), F32 as is.
The oracle reads them with gguf-py and transformers (its GGUF loader), not with our code."""

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

Q = gguf.GGMLQuantizationType
ARCHES = {
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_gguf(checkpoint: Path, out: Path, linear: Q, lm_head: Q = Q.F32, **kinds: Q) -> Path:
    """A GGUF of `checkpoint` at `out`: its projections in `linear` (or `kinds`' type for
    theirs: v_proj=Q.Q8_0), the LM head (if not tied) in `lm_head`, everything else F32."""
    config = json.loads((checkpoint / "config.json").read_text())
    arch = config["model_type"]
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[ARCHES[arch]])
    writer.add_name("tiny")  # transformers reads "mistral" in a name as an architecture
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, checkpoint)
    names = gguf.get_tensor_name_map(ARCHES[arch], layers)
    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(file))
    for name, tensor in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        data = tensor.float().numpy()
        if ARCHES[arch] == gguf.MODEL_ARCH.LLAMA and name.endswith(
            ("q_proj.weight", "k_proj.weight")
        ):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            data = permute_rows(data, heads)
        kind = name.rsplit(".", 2)[-2]
        if kind in LINEARS and name.endswith(".weight"):
            qtype = kinds.get(kind, linear)
        else:
            qtype = lm_head if kind == "lm_head" else Q.F32
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama's q and k rows (each head's halves
    interleaved)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def quantize(data: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return data.astype(np.float32)
    if qtype == Q.Q4_K:
        return quantize_q4_k(data)
    return gguf.quants.quantize(data, qtype)


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """ggml's block_q4_K for each 256 values of a row: f16 d, f16 dmin, 12 bytes of 6-bit
    sub-block scales and mins, 128 bytes of 4-bit values; y = d * sc * q - dmin * m."""
    rows = data.shape[0]
    x = data.reshape(-1, 8, 32).astype(np.float64)  # blocks, sub-blocks, values
    low, high = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    sub_scale, sub_min = (high - low) / 15, -low
    d = (sub_scale.max(-1) / 63).astype(np.float16)
    dmin = (sub_min.max(-1) / 63).astype(np.float16)
    d64, dmin64 = d.astype(np.float64)[:, None], dmin.astype(np.float64)[:, None]
    sc = np.clip(
        np.round(np.divide(sub_scale, d64, where=d64 > 0, out=np.zeros_like(sub_scale))), 0, 63
    )
    m = np.clip(
        np.round(np.divide(sub_min, dmin64, where=dmin64 > 0, out=np.zeros_like(sub_min))), 0, 63
    )
    step = (d64 * sc)[..., None]
    q = np.round(np.divide(x + (dmin64 * m)[..., None], step, where=step > 0, out=np.zeros_like(x)))
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)  # 64-value chunks, halves
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1
    )
    return blocks.reshape(rows, -1)


def _add_tokenizer(writer: gguf.GGUFWriter, checkpoint: Path) -> None:
    """The checkpoint's byte-level BPE as GGUF's "gpt2" tokenizer."""
    spec = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"] | {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = [None] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["id"] for t in spec["added_tokens"] if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    types = [
        gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    settings = json.loads((checkpoint / "tokenizer_config.json").read_text())
    eos = settings.get("eos_token")
    if eos in vocab:
        writer.add_eos_token_id(vocab[eos])
    template = checkpoint / "chat_template.jinja"  # where transformers 5 saves it
    chat_template = template.read_text() if template.exists() else settings.get("chat_template")
    if chat_template:
        writer.add_chat_template(chat_template)


def dequantized_weights(path: Path) -> dict[str, torch.Tensor]:
    """gguf-py's reading of every tensor, dequantized to float32: GGUF name -> [rows, cols]."""
    reader = gguf.GGUFReader(str(path))
    return {
        t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        for t in reader.tensors
    }
