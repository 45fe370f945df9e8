"""The kernels of the data plane: functions of tensors, importing nothing of the package outside
kernels/. Each Triton kernel is a `@triton.jit` function plus a launcher that asserts the
layouts it is given, naming the argument (kernels/layout.py).

    store_kvcache            write new tokens' K/V rows into their cache slots (-1 = skip)
    paged_decode_attention   one query per sequence over its block table (GQA, split-K)
    paged_prefill_attention  causal varlen attention, keys from the chunk or the paged cache
    fused_moe                a mixture of experts' two projections as grouped GEMMs over
                             the tokens sorted by expert
    lora_bgmv                LoRA's shrink and expand GEMMs, each row under its own adapter
    rms_norm, add_rms_norm,  the hot ops between the matmuls (fused_ops.py), one kernel each,
    silu_and_mul,            rounded as the eager ops are; CUDA runs those its platform's
    apply_rotary_emb         TRITON_HOT_OPS names

    cpu_decode               (C++, not Triton) the CPU's paged decode, see cpu_decode.py
    cpu_ops                  (C++) the CPU's RMSNorm (+ residual) and rotary, bit-equal to the
                             eager ops
    cpu_sample               (C++) the CPU's draw from softmax(logits), for sampling/ops.py;
                             the three C++ libraries built by cpu_build.py
    cpu_int8                 (C++) the CPU's int8 weight-only linear (W8A16), built there too
    cpu_int4                 (C++) the CPU's group-quantized int4 weight-only linear (W4A16),
                             integer dot products (VNNI); built there too
    torch_attention          (plain PyTorch) paged prefill and decode: the reference and the
                             `torch` backend's compute

Triton is imported, with every Triton kernel at once, when the first name below is
asked for (the CPU kernel needs no Triton). They run on CUDA tensors, or on CPU tensors
in Triton's interpreter when TRITON_INTERPRET=1 was set before that import.
"""

import importlib

_HOMES = {
    "interpreted": "layout",
    "paged_decode_attention": "paged_attention",
    "paged_prefill_attention": "paged_attention",
    "store_kvcache": "store_kvcache",
    "fused_moe": "fused_moe",
    "lora_bgmv": "lora",
    "rms_norm": "fused_ops",
    "add_rms_norm": "fused_ops",
    "silu_and_mul": "fused_ops",
    "apply_rotary_emb": "fused_ops",
}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    modules = {home: importlib.import_module(f"{__name__}.{home}") for home in _HOMES.values()}
    # Importing a submodule binds its name here (store_kvcache, fused_moe): rebind the
    # functions over the modules of the same name.
    globals().update({n: getattr(modules[home], n) for n, home in _HOMES.items()})
    return globals()[name]
