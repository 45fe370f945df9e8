"""ModelRunner: builds the model and its KV cache on a device, turns each scheduled
batch into input tensors and attention metadata, runs the model and samples.

Slot mapping (where each new token's K/V goes), for block_size 4:

    block_table = [7, 2]          position p -> slot block_table[p // 4] * 4 + p % 4
    positions     0  1  2  3 | 4  5
    slots        28 29 30 31 | 8  9

With tensor_parallel_size N, one ModelRunner per rank: rank 0 in the caller's process,
ranks 1..N-1 spawned (runner/distributed.py). Rank 0 drives each step with
`call("run", seqs, is_prefill)`, which runs it on every rank; only rank 0 samples.
"""
import weakref
from contextlib import contextmanager
from functools import cached_property
from itertools import chain

import torch
import torch.distributed as dist

from nanovllm.config import Config, checkpoint_dtype
from nanovllm.core.sequence import Sequence
from nanovllm.layers.attention import Attention, select_backend
from nanovllm.layers.context import AttentionMetadata, attention_context
from nanovllm.layers.parallel_state import SINGLE_RANK, TPGroup, tp_group_scope
from nanovllm.layers.sampler import Sampler
from nanovllm.models.registry import get_model_class
from nanovllm.runner.distributed import Rendezvous, WorkerGroup, connect_worker
from nanovllm.runner.loader import load_dummy_weights, load_model
from nanovllm.runner.sampling_metadata import TokenCounts, build_sampling_metadata

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, rank: int = 0, world_size: int = 1) -> torch.device:
    """The device of `rank`: the CPU, or with tensor parallelism GPU number `rank`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available; use 'cpu' or 'auto'")
    if world_size == 1:
        return torch.device("cuda")
    if world_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={world_size} needs one GPU per rank but "
                         f"{torch.cuda.device_count()} are visible; lower it or use device='cpu'")
    return torch.device("cuda", rank)


def resolve_dtype(name: str, hf_config) -> torch.dtype:
    name = checkpoint_dtype(hf_config) if name == "auto" else name
    if name not in _DTYPES:
        raise ValueError(f"checkpoint dtype {name!r} is not supported; pass dtype= one of "
                         f"{', '.join(_DTYPES)}")
    return _DTYPES[name]


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, rendezvous: Rendezvous | None = None):
        """Rank 0 is built by the engine; ranks > 0 by distributed.worker_main, with the
        `rendezvous` rank 0 opened."""
        self.config = config
        self.rank = rank
        self.block_size = config.kvcache_block_size
        self.device = resolve_device(config.device, rank, config.tensor_parallel_size)
        self.dtype = resolve_dtype(config.dtype, config.hf_config)
        self.backend = select_backend(config.attention_backend, self.device, self.block_size)
        self.workers: WorkerGroup | None = None  # rank 0's handle on ranks 1..N-1
        self.tp_group = self._init_tensor_parallel(rendezvous)
        self.model = self._build_model()
        self.sampler = Sampler()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if self.device.type == "cuda":
            self.warmup()
        self.num_kvcache_blocks = self.allocate_kv_cache()

    # -- setup --------------------------------------------------------------------

    def _init_tensor_parallel(self, rendezvous: Rendezvous | None) -> TPGroup:
        """Rank 0 spawns ranks 1..N-1 and stops them when it is closed, garbage-collected
        or at interpreter exit; a spawned rank joins rank 0's process group."""
        if self.config.tensor_parallel_size == 1:
            return SINGLE_RANK
        if not dist.is_available():
            raise ValueError("tensor_parallel_size > 1 needs torch.distributed, which this "
                             "PyTorch build lacks")
        if self.rank > 0:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            return connect_worker(rendezvous, self.rank, self.device)
        self.workers = WorkerGroup.spawn(self.config, self.device, type(self))
        self._stop_workers = weakref.finalize(self, self.workers.shutdown)
        return self.workers.tp_group

    def _build_model(self) -> torch.nn.Module:
        hf_config = self.config.hf_config
        with _default_dtype(self.dtype), self.device, tp_group_scope(self.tp_group):
            model = get_model_class(hf_config)(hf_config)
        if self.config.load_format == "dummy":
            load_dummy_weights(model, getattr(hf_config, "initializer_range", 0.02))
        else:
            load_model(model, self.config.model)
        return model.requires_grad_(False)

    @torch.inference_mode()
    def warmup(self) -> None:
        """A prefill at the largest batch, so the KV cache is sized after peak activations."""
        max_len = min(self.config.max_model_len, self.config.max_num_batched_tokens)
        num_seqs = max(1, min(self.config.max_num_batched_tokens // max_len, self.config.max_num_seqs))
        seqs = [Sequence([0] * max_len, None, self.block_size) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = max_len
            # Slots are computed but never written: there is no KV cache yet.
            seq.block_table = [0] * seq.num_blocks
        self._forward(*self.prepare_prefill(seqs))
        torch.cuda.synchronize()

    def allocate_kv_cache(self) -> int:
        """Allocate [2, layers, blocks, block_size, kv_heads, head_dim]; return the block count."""
        attn = self.attention_layers[0]
        block_shape = (self.block_size, attn.num_kv_heads, attn.head_dim)
        bytes_per_block = (2 * len(self.attention_layers) * self.block_size * attn.num_kv_heads
                           * attn.head_dim * self.dtype.itemsize)
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks < 0:
            # Block ids are shared by all ranks: each takes the smallest count any can fit.
            fits = torch.tensor([self._blocks_that_fit(bytes_per_block)], device=self.device)
            num_blocks = int(self.tp_group.all_reduce(fits, op="min").item())
        self.kv_cache = torch.zeros(2, len(self.attention_layers), num_blocks, *block_shape,
                                    dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            layer.backend = self.backend
        return num_blocks

    def _blocks_that_fit(self, bytes_per_block: int) -> int:
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
            hint = ("lower max_model_len / max_num_batched_tokens or raise "
                    "gpu_memory_utilization")
        else:
            budget = int(self.config.cpu_kvcache_space_gib * 2**30)
            hint = "raise cpu_kvcache_space_gib"
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"no memory is left for even one KV-cache block "
                             f"({bytes_per_block} bytes); {hint}")
        # More blocks than max_num_seqs full-length sequences could ever use is waste.
        blocks_per_seq = (self.config.max_model_len + self.block_size) // self.block_size
        return min(num_blocks, self.config.max_num_seqs * blocks_per_seq)

    def _cuda_kv_budget(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        # What this process may still take under the utilization cap, never more than
        # is free now (other processes' memory is not ours to count on).
        return int(min(total * self.config.gpu_memory_utilization - peak, free - (peak - current)))

    # -- a step -------------------------------------------------------------------

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Inputs for each sequence's chunk: tokens [num_cached, num_cached + num_scheduled)."""
        starts = [seq.num_cached_tokens for seq in seqs]
        seqlens_q = [seq.num_scheduled_tokens for seq in seqs]
        seqlens_k = [start + n for start, n in zip(starts, seqlens_q)]
        input_ids = list(chain.from_iterable(
            seq.token_ids[start:end] for seq, start, end in zip(seqs, starts, seqlens_k)))
        lens_q = torch.tensor(seqlens_q)
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), lens_q)  # [num_tokens]
        cu_seqlens_q = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(lens_q, 0, out=cu_seqlens_q[1:])
        cu_seqlens_k = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(seqlens_k), 0, out=cu_seqlens_k[1:])
        # position of each token = its sequence's start + its offset in the chunk
        offsets = torch.arange(len(input_ids)) - cu_seqlens_q[:-1].long()[seq_index]
        positions = torch.tensor(starts)[seq_index] + offsets
        block_tables = self._block_tables(seqs)
        slot_mapping = self._slots(block_tables, seq_index, positions)
        has_prefix = any(starts)
        metadata = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._to_device(slot_mapping),
            block_tables=self._to_device(block_tables) if has_prefix else None,
            cu_seqlens_q=self._to_device(cu_seqlens_q),
            cu_seqlens_k=self._to_device(cu_seqlens_k),
            max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
            seqlens_q=seqlens_q, seqlens_k=seqlens_k)
        return (self._to_device(torch.tensor(input_ids)), self._to_device(positions), metadata)

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Inputs for one token per sequence: the last one, at position len(seq) - 1."""
        positions = torch.tensor([len(seq) - 1 for seq in seqs])
        block_tables = self._block_tables(seqs)
        slot_mapping = self._slots(block_tables, torch.arange(len(seqs)), positions)
        metadata = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self._to_device(slot_mapping),
            block_tables=self._to_device(block_tables),
            context_lens=self._to_device((positions + 1).int()))
        input_ids = torch.tensor([seq.last_token for seq in seqs])
        return self._to_device(input_ids), self._to_device(positions), metadata

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """[num_seqs, max_blocks] int32, padded with -1."""
        width = max(len(seq.block_table) for seq in seqs)
        return torch.tensor([seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs],
                            dtype=torch.int32)

    def _slots(self, block_tables: torch.Tensor, seq_index: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        blocks = block_tables[seq_index, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def call(self, method: str, *args) -> object:
        """Rank 0: run `method(*args)` on every rank; returns rank 0's result. Raises
        RuntimeError if a worker has died."""
        if self.workers is None:
            return getattr(self, method)(*args)
        return self.workers.call(getattr(self, method), method, args)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int] | None:
        """One step: a token id per sequence on rank 0 (None on other ranks)."""
        prepare = self.prepare_prefill if is_prefill else self.prepare_decode
        logits = self._forward(*prepare(seqs))
        if self.rank != 0:
            return None
        return self.sample(seqs, logits)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor | None:
        with attention_context(metadata):
            return self.model.compute_logits(self.model(input_ids, positions))

    # EOS ids that min_tokens keeps from being sampled; the engine sets them.
    eos_token_ids: frozenset[int] = frozenset()

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        metadata = build_sampling_metadata(seqs, logits.shape[-1], self.eos_token_ids,
                                           lambda: self.token_counts, self._to_device)
        return self.sampler(logits, metadata).tolist()

    @cached_property
    def token_counts(self) -> TokenCounts:
        """Penalties' per-sequence token counts, allocated when a request first has one."""
        return TokenCounts(self.config.hf_config.vocab_size, self.device)

    def close(self) -> None:
        """Free the KV cache; rank 0 stops its workers, a worker leaves the process group."""
        if self.workers is not None:
            self._stop_workers()  # a finalizer: runs WorkerGroup.shutdown at most once
        elif self.rank > 0:
            self.tp_group.shutdown()
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = None
