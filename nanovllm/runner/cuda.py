"""What a CUDA runner adds: before its KV cache exists, the memory measurements that size it
(docs/cuda.md says why each term is there) and a warmup that compiles every kernel up front;
each step, its host-built inputs copied to the device without a sync (on_device).

    budget = min(gpu_memory_utilization * total - peak - graph_pool,
                 free - (peak - current) - graph_pool) - SAFETY_MARGIN

(kv_cache_budget). peak and current are this process's own use: PyTorch's reserved memory
plus what appeared outside it since start-up (NCCL buffers, kernels). Other processes' memory
only lowers `free`: it can shrink the cache, never drive the arithmetic negative."""

from dataclasses import fields, replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from nanovllm.core.sequence import Sequence
from nanovllm.device import to_device
from nanovllm.runner.kv_cache import bind_kv_cache
from nanovllm.runner.step_inputs import StepInputs, prepare_inputs
from nanovllm.sampling.metadata import SamplingMetadataBuilder
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.runner.cuda_graph import CUDAGraphRunner
    from nanovllm.runner.model_runner import ModelRunner


class MemoryProfile(NamedTuple):
    """Device memory in bytes, as kv_cache_budget reads it."""

    total: int  # the device's
    free: int  # free on the device now (all processes)
    peak: int  # this process's peak use
    current: int  # this process's use now
    graph_pool: int  # still to come: the CUDA graphs' pool (0 without graphs)


SAFETY_MARGIN = 256 * 2**20  # allocator fragmentation: a cache sized to the byte can OOM


def kv_cache_budget(p: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Bytes the KV cache may take, SAFETY_MARGIN kept free; 0 when nothing is left.
    `peak - current` is activation memory needed again."""
    within_cap = gpu_memory_utilization * p.total - p.peak - p.graph_pool - SAFETY_MARGIN
    actually_free = p.free - (p.peak - p.current) - p.graph_pool - SAFETY_MARGIN
    return max(0, int(min(within_cap, actually_free)))


def untracked_memory(device: torch.device) -> int:
    """Device memory in use outside PyTorch's allocator (the CUDA context, other processes)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def measure_kv_cache_budget(runner: "ModelRunner") -> int:
    """Bytes left for the KV cache after the graphs' pool (a trial capture) and a warmup.
    PyTorch's cache is emptied first, so `free` includes the activations' memory."""
    graph_pool = 0
    if runner.graph_runner is not None:
        bind_kv_cache(runner.attention_layers, runner.new_kv_cache(1))
        graph_pool = measure_graph_pool(runner.graph_runner)  # all padding: 1 block will do
        bind_kv_cache(runner.attention_layers, None)
    peak = warmup(runner)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    reserved = torch.cuda.memory_reserved(runner.device)
    grown = max(0, total - free - reserved - runner.untracked_at_start)  # outside PyTorch
    profile = MemoryProfile(total, free, peak + grown, reserved + grown, graph_pool)
    return kv_cache_budget(profile, runner.config.gpu_memory_utilization)


@torch.inference_mode()
def measure_graph_pool(graphs: "CUDAGraphRunner") -> int:
    """Bytes the decode graphs' pool will take, before the KV cache is sized: the largest size
    captured on trial (every row padding: any KV cache will do), released again."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(graphs.device)
    graphs.pool = torch.cuda.graph_pool_handle()
    graph = graphs.capture_size(graphs.batch_sizes[-1])
    used = torch.cuda.memory_reserved(graphs.device) - before
    graph.reset()
    graphs.pool = None
    torch.cuda.empty_cache()
    return max(0, used)


@torch.inference_mode()
def warmup(runner: "ModelRunner") -> int:
    """The peak PyTorch-reserved memory of a prefill at the largest batch, then (rank 0) of
    the sampler at the most rows ([rows, vocab] float32 temporaries can outgrow it)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(runner.device)
    config = runner.config
    max_len = min(config.max_model_len, config.max_num_batched_tokens)
    num_seqs = min(config.max_num_batched_tokens // max_len, config.max_num_seqs)  # >= 1
    seqs = [Sequence([0] * max_len, None, runner.block_size) for _ in range(num_seqs)]
    for seq in seqs:
        seq.num_scheduled_tokens = max_len
        # Slots are computed but never written: there is no KV cache yet.
        seq.block_table.extend([0] * seq.num_blocks)
    runner.forward(prepare_inputs(seqs, runner.block_size))
    if runner.rank == 0:
        warmup_sampler(runner)
    torch.cuda.synchronize(runner.device)
    return torch.cuda.max_memory_reserved(runner.device)


def warmup_sampler(runner: "ModelRunner") -> None:
    """Every option at the most rows, then plain sampling at that many, one fewer and one:
    the compiled sampler compiles (static, dynamic, size 1) now, not in a run."""
    rows = min(runner.config.max_num_seqs, runner.config.max_num_batched_tokens)
    vocab_size = runner.config.hf_config.vocab_size
    everything = SamplingParams(
        top_k=max(1, vocab_size // 2),
        top_p=0.9,
        min_p=0.01,
        seed=0,
        min_tokens=1,
        stop_token_ids=[0],
        repetition_penalty=1.1,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        logit_bias={0: 1},
    )
    plain = SamplingParams()
    for params, num_rows in (
        (everything, rows),
        (plain, rows),
        (plain, max(1, rows - 1)),
        (plain, 1),
    ):
        seqs = [Sequence([0], params, runner.block_size) for _ in range(num_rows)]
        # A builder of its own: the penalties' counts are dropped after, the worst case.
        metadata = SamplingMetadataBuilder(vocab_size, runner.device).build(seqs)
        logits = torch.zeros(num_rows, vocab_size, dtype=runner.dtype, device=runner.device)
        runner.sampler(logits, metadata)


def on_device(inputs: StepInputs, device: torch.device) -> StepInputs:
    """Host-built inputs with every tensor (the context's and its metadata's too) on `device`:
    from pinned memory, non-blocking, queued behind the device's work."""
    ctx = inputs.context
    return StepInputs(
        to_device(inputs.input_ids, device),
        to_device(inputs.positions, device),
        replace(
            _moved(ctx, device),
            decode=_moved(ctx.decode, device),
            prefill=_moved(ctx.prefill, device),
        ),
    )


def _moved(obj: object, device: torch.device) -> object:
    """A dataclass with its tensor fields copied to `device`; None stays None."""
    if obj is None:
        return None
    tensors = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            tensors[f.name] = to_device(value, device)
    return replace(obj, **tensors)
