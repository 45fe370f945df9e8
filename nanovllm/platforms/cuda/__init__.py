"""The CUDA platform: the GPU's memory measured to size the KV cache (memory.py), decode replayed
from CUDA graphs (graphs.py), the hot ops compiled by torch.compile or, where TRITON_HOT_OPS says,
run as Triton kernels of their own (and an MoE layer's experts as a Triton grouped GEMM), the
attention kernels of flash-attn or our Triton ones, each step's inputs copied from pinned memory
without a sync."""

from collections.abc import Callable

import torch
from torch import nn

from nanovllm.attention.backend import AttentionBackend
from nanovllm.compilation import HotOp, OpChoice
from nanovllm.config import Config
from nanovllm.platforms.cuda.graphs import CUDAGraphRunner
from nanovllm.platforms.cuda.memory import measure_kv_cache_budget, on_device, untracked_memory
from nanovllm.platforms.interface import FastDecode, Inputs, MemorySizing, Placement, Platform


class CudaPlatform(Platform):
    attention_backends = ("flash_attn", "triton", "torch")
    kv_cache_hint = "lower max_model_len / max_num_batched_tokens or raise gpu_memory_utilization"

    def __init__(self, config: Config, placement: Placement):
        super().__init__(config, placement)
        self.device = cuda_device(placement)
        self.untracked_at_start = untracked_memory(self.device)  # the context, other processes

    def op_choice(self) -> OpChoice:
        return eager_cuda_ops if self.config.enforce_eager else compiled_cuda_ops

    def fast_decode(
        self, model: nn.Module, dtype: torch.dtype, backend: AttentionBackend
    ) -> FastDecode | None:
        if not captures_decode(self.config.enforce_eager, backend):
            return None
        return CUDAGraphRunner(model, self.config, dtype, self.device)

    def kv_cache_budget(self, sizing: MemorySizing) -> int:
        utilization = self.config.gpu_memory_utilization
        return measure_kv_cache_budget(sizing, self.device, self.untracked_at_start, utilization)

    def warmup(self, sizing: MemorySizing) -> None:
        """Nothing to size, but kernels and compiled ops compile now rather than in a step."""
        sizing.profile_run()

    def to_device(self, inputs: Inputs) -> Inputs:
        return on_device(inputs, self.device)

    def release_memory(self) -> None:
        torch.cuda.empty_cache()  # back to the device, e.g. for the next engine's sizing


def captures_decode(enforce_eager: bool, backend: AttentionBackend) -> bool:
    """Decode CUDA graphs, unless enforce_eager; only a backend whose decode never syncs with the
    host can be captured."""
    return not enforce_eager and backend.capturable


def cuda_device(placement: Placement) -> torch.device:
    """GPU number `gpu_index` of this machine's (None: the current one), of which `gpus_needed`
    must be visible."""
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is unavailable; use 'cpu' or 'auto'")
    if placement.gpus_needed > torch.cuda.device_count():
        raise ValueError(
            f"{placement.gpus_needed} GPUs are needed here (one per rank: tensor_parallel_size, "
            f"or torchrun's ranks per node) but {torch.cuda.device_count()} are visible; "
            "start fewer ranks or use device='cpu'"
        )
    index = placement.gpu_index
    return torch.device("cuda") if index is None else torch.device("cuda", index)


def triton_fused_moe(*args: torch.Tensor) -> torch.Tensor:
    """An MoE layer's experts as the Triton grouped GEMM (imports Triton on first call)."""
    from nanovllm.kernels.fused_moe import fused_moe

    return fused_moe(*args)


def triton_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mapping, slice_ends
) -> torch.Tensor:
    """LoRA layers' adapters (lora/ops.py) as Triton kernels reading each row's slot on the
    device (imports Triton on first call)."""
    from nanovllm.kernels.lora import lora_bgmv

    return lora_bgmv(y, x, a, b, mapping.slots)


# Hot ops with a kernel of their own on CUDA, compiled or not; by the op's name.
KERNELS: dict[str, Callable] = {"fused_moe_torch": triton_fused_moe, "lora_delta": triton_lora}
# Hot ops that have a Triton kernel of the same name and contract in kernels/fused_ops.py.
FUSED_OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "apply_rotary_emb")
# Those of them that run as that kernel instead of torch.compile's twin (or, under enforce_eager,
# the eager op). None yet: benchmarks/compiled_ops.py on a GPU times the three (the GPU check's
# "compiled ops" stage) and decides which go here (docs/cuda.md).
TRITON_HOT_OPS: frozenset[str] = frozenset()


def fused_kernel(op: HotOp) -> Callable | None:
    """The op's Triton kernel where TRITON_HOT_OPS names it (imports Triton then)."""
    if op.name not in TRITON_HOT_OPS:
        return None
    from nanovllm.kernels import fused_ops

    return getattr(fused_ops, op.name)


def eager_cuda_ops(op: HotOp) -> Callable:
    return KERNELS.get(op.name) or fused_kernel(op) or op.eager


def compiled_cuda_ops(op: HotOp) -> Callable:
    return KERNELS.get(op.name) or fused_kernel(op) or op.compiled()
