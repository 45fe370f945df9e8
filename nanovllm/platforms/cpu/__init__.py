"""The CPU platform: slower than a GPU but the same engine, tuned where PyTorch leaves time on the
table (docs/cpu.md has the measurements behind each):

    host.py          dtype="auto" is float32 where half precision is emulated; freed memory kept
    threads.py       how many threads, and fewer while the CPU is shared (the governor)
    ops.py           native twins of the hot ops (C++, built on first use)
    weights.py       linears read oneDNN-packed copies of their weights; or quantization/ (int8)
    decode_step.py   the decode fast path: a dense decoder's whole decode step in one C++ call
"""

import torch
from torch import nn

from nanovllm.attention.backend import AttentionBackend
from nanovllm.compilation import OpChoice
from nanovllm.config import PUBLISHED_QUANTIZATIONS, Config
from nanovllm.platforms.cpu import host, ops, threads
from nanovllm.platforms.cpu.decode_step import native_decode_step
from nanovllm.platforms.cpu.weights import pack_linear_weights_if_they_fit
from nanovllm.platforms.interface import FastDecode, MemorySizing, Placement, Platform


class CpuPlatform(Platform):
    device = torch.device("cpu")
    kv_cache_hint = "raise cpu_kvcache_space_gib"

    def __init__(self, config: Config, placement: Placement):
        super().__init__(config, placement)
        host.keep_freed_host_memory()
        chosen = threads.set_num_threads(config.cpu_threads, placement.local_ranks)
        self.governor = None  # fewer threads while the CPU is shared, for a count it chose
        if chosen.chosen and chosen.num_threads > 1 and placement.local_ranks == 1:
            self.governor = threads.ThreadGovernor(chosen.num_threads)
        ops.load_kernels()

    def auto_dtype(self, checkpoint: str, model_class: type[nn.Module]) -> str:
        return host.auto_dtype(checkpoint, self.config, model_class)

    def op_choice(self) -> OpChoice:
        return ops.native_ops

    def prepare_weights(self, model: nn.Module) -> None:
        """int8 or int4 weights when asked for (quantization/); else, and beside the layers of a
        checkpoint published quantized (which loading gave Int4Weight), oneDNN-packed copies
        where they fit."""
        if self.config.quantization not in (None, *PUBLISHED_QUANTIZATIONS):
            from nanovllm.quantization import quantize_model

            quantize_model(model, self.config.quantization)
            return
        pack_linear_weights_if_they_fit(model, self.config.tensor_parallel_size)

    def fast_decode(
        self, model: nn.Module, dtype: torch.dtype, backend: AttentionBackend
    ) -> FastDecode | None:
        """The native decode step (decode_step.py): not with cpu_decode_step=False (nor
        enforce_eager, nor where the step cannot run this model)."""
        if not self.config.cpu_decode_step:
            return None
        return native_decode_step(model, self.config, dtype)

    def kv_cache_budget(self, sizing: MemorySizing) -> int:
        return int(self.config.cpu_kvcache_space_gib * 2**30)

    def after_step(self) -> None:
        if self.governor is not None:
            self.governor.after_step()
