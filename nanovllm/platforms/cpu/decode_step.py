"""A CPU's decode step in one native call (kernels/cpu_step.py), its counterpart of the CUDA
graphs (a FastDecode, platforms/interface.py): the embedding, every layer, the final norm and
the LM head of a dense decoder (Qwen3, Qwen2, Llama, Mistral) for small decode batches
(max_rows()), with no PyTorch op between (a head whose format the step cannot read runs after
it, eagerly). Its linears read float32 weights or int8 or int4 ones (their formats' own
`native_linear`, layers of each kind mixed); a weight format without it, prefill chunks, larger
batches, MoE, tensor parallelism, half precision and enforce_eager run the eager model. In
a small model's decode step most of the time went to the PyTorch ops around each layer's GEMVs
(the figures: docs/cpu.md#the-native-decode-step)."""

import torch
from torch import nn

from nanovllm.attention.metadata import ForwardContext
from nanovllm.config import Config
from nanovllm.kernels import cpu_step
from nanovllm.models.decoder import DecoderForCausalLM, DecoderMLP
from nanovllm.platforms.cpu.weights import PackedWeight

# The most decode rows a step runs natively, where it measured faster than the eager layers
# (docs/cpu.md#the-native-decode-step). Float32: the step's GEMV reads a weight once for all its
# rows but sums each row apart, where oneDNN's packed GEMM (weights.py, the eager layers' from 2
# rows) tiles rows in registers. Where a layer's weights stay in the caches (a small model) the
# PyTorch ops the step saves weigh most: up to F32_MAX_ROWS_CACHED rows; where they stream from
# memory (Qwen3-0.6B's, 63 MB a layer), F32_MAX_ROWS. Int8 and int4 weights take the same kernel
# either way, up to where the eager path dequantizes them (int8 on AVX2).
F32_MAX_ROWS = 2
F32_MAX_ROWS_CACHED = 16
F32_CACHED_LAYER_BYTES = 8 * 2**20  # a layer's float32 linears at most this: "in the caches"
INT8_MAX_ROWS = 128
INT4_MAX_ROWS = 128


def native_decode_step(
    model: nn.Module, config: Config, dtype: torch.dtype
) -> "NativeDecodeStep | None":
    """The step for this model where it can run it, else None."""
    dense = isinstance(model, DecoderForCausalLM) and all(
        isinstance(layer.mlp, DecoderMLP) for layer in model.model.layers
    )
    if not dense or dtype != torch.float32 or config.tensor_parallel_size > 1:
        return None
    if config.enforce_eager or config.attention_backend not in ("auto", "torch"):
        return None
    if config.enable_lora:  # its GEMMs read the weights alone: the adapters would be left out
        return None
    if not cpu_step.usable():
        return None
    linears = [_linear(linear) for layer in model.model.layers for linear in _linears(layer)]
    if any(linear is None for linear in linears):
        return None  # a weight format the step cannot read
    return NativeDecodeStep(model, config.kvcache_block_size, max_rows(model, linears))


class NativeDecodeStep:
    def __init__(self, model: DecoderForCausalLM, block_size: int, max_rows: int):
        self.model, self.block_size, self.max_rows = model, block_size, max_rows
        self.step: cpu_step.DecoderStep | None = None
        self.eager_head = False  # the LM head's format is not one the step reads

    def capture(self) -> None:
        """Hand the C++ the weights' and the KV cache's addresses (once the cache is bound)."""
        decoder, first = self.model.model, self.model.model.layers[0].self_attn
        shape = cpu_step.Shape(
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            self.block_size,
            decoder.norm.eps,
            first.attn.scale,
        )
        layers = [self._layer(layer) for layer in decoder.layers]
        rope = first.rotary_emb.cos_sin_cache
        embed, norm = decoder.embed_tokens.weight, decoder.norm.weight
        head = _linear(self.model.lm_head)
        self.step = cpu_step.DecoderStep(cpu_step.load(), shape, embed, norm, rope, layers, head)
        self.eager_head = head is None

    def _layer(self, layer: nn.Module) -> cpu_step.Layer:
        attn = layer.self_attn
        qk_norm = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        return cpu_step.Layer(
            *(_linear(linear) for linear in _linears(layer)),
            *norms,
            *qk_norm,
            attn.attn.k_cache,
            attn.attn.v_cache,
        )

    def can_run(self, rows: int) -> bool:
        return self.step is not None and rows <= self.max_rows

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        """The logits [rows, vocab] of a decode-only step."""
        meta = ctx.decode
        out = self.step(
            input_ids, positions, ctx.slot_mapping, meta.block_tables, meta.context_lens
        )
        return self.model.compute_logits(out) if self.eager_head else out

    def close(self) -> None:
        self.step = None


def max_rows(model: DecoderForCausalLM, linears: list[cpu_step.Linear]) -> int:
    """The most rows a step runs natively: the least of its linears' limits, a quantized one's
    also no more than its format runs its kernel for (int4.py's KERNEL_MAX_ROWS: 8 rows with
    plain loops)."""
    formats = [linear.weight_format for layer in model.model.layers for linear in _linears(layer)]
    if (head := _linear(model.lm_head)) is not None:  # the step runs it too
        linears, formats = [*linears, head], [*formats, model.lm_head.weight_format]
    limits = []
    for linear, weight_format in zip(linears, formats):
        if linear.group_size or linear.scale is not None:
            limit = INT4_MAX_ROWS if linear.group_size else INT8_MAX_ROWS
            limits.append(min(limit, getattr(weight_format, "max_rows", limit)))
        else:
            limits.append(f32_max_rows(model))
    return min(limits)


def f32_max_rows(model: DecoderForCausalLM) -> int:
    """The float32 row limit for this model, by the bytes of one layer's linear weights."""
    layer = model.model.layers[0]
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj)
    weights = [linear.weight for linear in (*linears, layer.mlp.down_proj)]
    layer_bytes = sum(w.numel() * w.element_size() for w in weights)
    return F32_MAX_ROWS_CACHED if layer_bytes <= F32_CACHED_LAYER_BYTES else F32_MAX_ROWS


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _linear(layer: nn.Module) -> cpu_step.Linear | None:
    """What the step reads of a linear (or of the LM head, which has no bias): its float32
    weight (F.linear's, or oneDNN's packed copy beside it), or what its weight format hands the
    step (`native_linear(bias)`: the int8 or int4 kernel's panels, quantization/); None for a
    format without it."""
    weight_format, bias = layer.weight_format, getattr(layer, "bias", None)
    if weight_format is None or isinstance(weight_format, PackedWeight):
        return cpu_step.Linear(layer.weight, bias)
    native = getattr(weight_format, "native_linear", None)
    return None if native is None else native(bias)
