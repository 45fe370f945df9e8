"""A CPU's hot ops (compilation.py): native twins of the eager ones, one C++ call each instead of
PyTorch's 5-10 small ops (kernels/cpu_ops.py: RMSNorm, RMSNorm after the residual add, rotary,
bit-equal to the eager ops), and the sampler's draw by the inverse CDF and its argmax
(kernels/cpu_sample.py).
Where a twin's C++ cannot run (no compiler, a dtype or layout it does not cover) it calls the
eager op. SiLU-and-mul and an MoE layer's experts stay eager."""

from collections.abc import Callable
from functools import partial

import torch

from nanovllm.compilation import HotOp
from nanovllm.kernels import cpu_decode, cpu_lora, cpu_ops, cpu_sample
from nanovllm.layers.layernorm import add_rms_norm, rms_norm
from nanovllm.layers.rotary_embedding import apply_rotary_emb
from nanovllm.sampling.ops import greedy_ids, inverse_cdf_index, softmax_race


def inverse_cdf(logits: torch.Tensor) -> torch.Tensor:
    """softmax_race's draw on a CPU: one uniform a row from torch.rand (a manual_seed
    reproduces it), searched in a float64 CDF of the softmax (float64 keeps each token's
    probability as its step; a float32 sum over a real vocabulary would round tiny ones to
    nothing). A probability-0 token (filtered to -inf) is never drawn. Fused in
    cpu_sample.cpp where it builds (nothing [B, vocab] written: faster than torch's softmax and
    cumsum, themselves faster than the race's noise: docs/cpu.md), else those."""
    u = 1 - torch.rand(len(logits), 1, dtype=torch.float64)  # (0, 1]: never a p = 0 token's CDF
    library = cpu_sample.load() if logits.dtype == torch.float32 else None
    if library is None:
        return inverse_cdf_index(torch.softmax(logits, dim=-1), u)
    return cpu_sample.sample(library, logits, u)


def native_greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """greedy_ids in cpu_sample.cpp where it builds (float32 logits), else torch's argmax."""
    library = cpu_sample.load() if logits.dtype == torch.float32 else None
    if library is None:
        return greedy_ids.eager(logits)
    return cpu_sample.argmax(library, logits.contiguous())


# Rows up to which a LoRA layer's adapters run in one C++ call; more (a prefill chunk) run the
# eager op's GEMMs per adapter, whose cost a few rows do not repay (docs/lora.md).
LORA_NATIVE_MAX_ROWS = 256


def native_lora_delta(eager: Callable, y, x, a, b, mapping, slice_ends) -> torch.Tensor:
    """A LoRA layer's adapters (lora/ops.py): a decode step's rows in one C++ call
    (kernels/cpu_lora.py), or the eager op."""
    if len(x) <= LORA_NATIVE_MAX_ROWS and cpu_lora.fits(x, a, b, y):
        if (library := cpu_lora.load()) is not None:
            return cpu_lora.lora_bgmv(library, y, x, a, b, mapping.slots, slice_ends)
    return eager(y, x, a, b, mapping, slice_ends)


# The twins of seams' hot ops, by the op's name: their modules are imported only when on.
NATIVE_BY_NAME: dict[str, Callable] = {"lora_delta": native_lora_delta}

NATIVE: dict[HotOp, Callable] = {
    rms_norm: partial(cpu_ops.rms_norm, rms_norm.eager),
    add_rms_norm: partial(cpu_ops.add_rms_norm, add_rms_norm.eager),
    apply_rotary_emb: partial(cpu_ops.apply_rotary_emb, apply_rotary_emb.eager),
    softmax_race: inverse_cdf,
    greedy_ids: native_greedy_ids,
}


def native_ops(op: HotOp) -> Callable:
    """A CPU platform's OpChoice: the native twin where there is one."""
    if op.name in NATIVE_BY_NAME:
        return partial(NATIVE_BY_NAME[op.name], op.eager)
    return NATIVE.get(op, op.eager)


def load_kernels() -> None:
    """Build (first run only: seconds) and load the C++ every CPU step calls, now rather than in
    the first step."""
    cpu_ops.load()
    cpu_sample.load()
    cpu_decode.load()  # the torch attention backend's decode
