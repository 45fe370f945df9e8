"""The Platform interface: everything the model runner does differently on one kind of device,
asked for by name so that the runner itself never asks which device it is on.

    building   device and dtype ("auto"), the attention backends to try, which hot ops layers
               take (compiled on CUDA, native twins on a CPU), what becomes of the weights once
               loaded (a CPU packs or quantizes them)
    sizing     the KV cache's memory budget (CUDA measures it after a profile run), a warmup
    stepping   the decode fast path (CUDA graphs, a CPU's native step), host -> device copies,
               what runs after each step (a CPU's thread governor)
    closing    memory given back to the device

A run imports one platform: platforms/cpu/ or platforms/cuda/ (get_platform)."""

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar

import torch
from torch import nn

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import ForwardContext
from nanovllm.compilation import OpChoice, eager_ops

if TYPE_CHECKING:
    from nanovllm.config import Config

Inputs = TypeVar("Inputs")  # a step's inputs: tensors, in a NamedTuple and dataclasses


class Placement(NamedTuple):
    """Where one rank of an engine runs."""

    gpu_index: int | None  # its GPU (None: the current one); a CPU has no index
    gpus_needed: int  # GPUs that must be visible (one per rank on this machine)
    local_ranks: int  # this engine's processes on this machine, sharing its CPUs


class FastDecode(Protocol):
    """A platform's faster way to run a pure decode step than the eager model. Built before the
    KV cache and captured once it is bound: it holds the cache's address (and the weights')."""

    def capture(self) -> None: ...

    def can_run(self, num_rows: int) -> bool: ...

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The logits [num_rows, vocab] of a decode-only step (rank 0's; None on the others),
        as the model's compute_logits() returns them."""
        ...

    def close(self) -> None: ...


class MemorySizing(Protocol):
    """What the runner lends a platform that sizes the KV cache by measuring."""

    fast_decode: FastDecode | None

    def profile_run(self) -> None:
        """The largest step the scheduler can make, then the sampler at its most rows."""
        ...

    def trial_kv_cache(self) -> AbstractContextManager[None]:
        """A one-block KV cache bound to the layers meanwhile (enough to capture a decode)."""
        ...


class Platform:
    """One device kind's answers. Defaults are the plain ones; a platform overrides what it
    does differently, and must answer fast_decode and kv_cache_budget."""

    device: torch.device
    # "auto"'s attention backends, the best first ("torch" runs anywhere: the last resort)
    attention_backends: tuple[str, ...] = ("torch",)
    kv_cache_hint: str  # what to change when not even one KV-cache block fits

    def __init__(self, config: "Config", placement: Placement):
        self.config = config

    def auto_dtype(self, checkpoint: str, model_class: type[nn.Module]) -> str:
        """dtype="auto": the checkpoint's."""
        return checkpoint

    def op_choice(self) -> OpChoice:
        """The hot ops layers take (compilation.py)."""
        return eager_ops

    def prepare_weights(self, model: nn.Module) -> None:
        """After loading: give linears a WeightFormat (a platform's packing, a quantization)."""
        if self.config.quantization is not None:
            raise ValueError(
                f"quantization={self.config.quantization!r} runs on a CPU (its GEMM is a CPU "
                f"kernel), not on {self.device.type}; pass device='cpu', or no quantization"
            )

    def fast_decode(
        self, model: nn.Module, dtype: torch.dtype, backend: AttentionBackend
    ) -> FastDecode | None:
        """The decode fast path for this model, where it has one and may use it."""
        raise NotImplementedError

    def kv_cache_budget(self, sizing: MemorySizing) -> int:
        """Bytes the KV cache may take."""
        raise NotImplementedError

    def warmup(self, sizing: MemorySizing) -> None:
        """With num_kvcache_blocks given (nothing to size): whatever would otherwise happen in
        the first step (compiling)."""

    def to_device(self, inputs: Inputs) -> Inputs:
        """A step's host-built inputs (runner/step_inputs.py), on the device."""
        return inputs

    def after_step(self) -> None:
        """Runs after every step."""

    def release_memory(self) -> None:
        """Give cached memory back to the device (the engine is closing)."""
