"""ModelRunner: builds the model and its KV cache on a device, runs each scheduled batch
(step_inputs.py) and samples. With tensor parallelism one per rank; rank 0 drives each step
with `call("forward", inputs)` (the step's host-built tensors; workers never see a Sequence)
and alone samples."""

import logging
import math
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from nanovllm.attention import ForwardContext, attention_context, select_backend
from nanovllm.compilation import compile_scope
from nanovllm.config import Config
from nanovllm.core.sequence import PENDING, Sequence
from nanovllm.distributed.group import SINGLE_RANK, TPGroup, tp_group_scope
from nanovllm.distributed.launch import engine_store, join_replica_tp_group, torchrun_launch
from nanovllm.distributed.workers import WorkerGroup, connect_worker
from nanovllm.layers.attention import Attention
from nanovllm.layers.linear import pack_linear_weights
from nanovllm.models.loader import load_dummy_weights, load_model
from nanovllm.models.registry import get_model_class
from nanovllm.runner.cuda_graph import CUDAGraphRunner, block_table_width, use_cuda_graphs
from nanovllm.runner.device import (
    keep_freed_host_memory,
    list_to_device,
    physical_memory,
    resolve_device,
    resolve_dtype,
    to_device,
)
from nanovllm.runner.kv_cache import (
    MemoryProfile,
    bind_kv_cache,
    kv_cache_budget,
    kv_cache_shape,
    num_blocks_within,
    untracked_cuda_memory,
)
from nanovllm.runner.step_inputs import StepInputs, logits_rows, on_device, prepare_inputs
from nanovllm.sampling.logprobs import collect_logprobs, find_logprob_rows, raw_logprobs
from nanovllm.sampling.metadata import TokenCounts, build_sampling_metadata
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling_params import SamplingParams


class SamplerOutput(NamedTuple):
    token_ids: torch.Tensor | list[int]  # [num_seqs]; run() returns them as a list
    logprobs: list[dict | None] | None = None  # per sequence: its sampled token's entry
    prompt_logprobs: list[list[dict]] | None = None  # per sequence: its new prompt entries


class ModelRunner:
    """Built in order: the model (CUDA: compiled small ops), on CUDA the memory measurements
    (graph pool, warmup), the KV cache, then the decode graphs, which hold its address."""

    def __init__(self, config: Config, rank: int = 0, port: int = 0):
        """Rank 0 is built by the engine; ranks > 0 by distributed.worker_main (rank 0's `port`)."""
        self.config = config
        # Under torchrun every rank runs the engine; its place comes from torchrun's variables.
        self.launch = torchrun_launch(config.tensor_parallel_size, config.data_parallel_size)
        self.rank = rank if self.launch is None else self.launch.tp_rank
        self.block_size = config.kvcache_block_size
        self.device = resolve_device(
            config.device, self.launch, self.rank, config.tensor_parallel_size
        )
        if self.device.type == "cpu":
            keep_freed_host_memory()
        self.dtype = resolve_dtype(
            config.dtype,
            config.hf_config,
            self.device,
            self._float32_bytes() if self.device.type == "cpu" else 0,
        )
        self.backend = select_backend(config.attention_backend, self.device, self.block_size)
        self.workers: WorkerGroup | None = None  # rank 0's handle on ranks 1..N-1
        self.tp_group = self._init_tensor_parallel(port)
        is_cuda = self.device.type == "cuda"
        self.untracked_at_start = untracked_cuda_memory(self.device) if is_cuda else 0
        # CUDA: small ops compiled, decode replayed from graphs (not under enforce_eager)
        with compile_scope(is_cuda and not config.enforce_eager):
            self.model = self._build_model()
            self.sampler = Sampler()
        if self.device.type == "cpu":
            self._pack_cpu_linears()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.backend
        # Penalties' per-sequence token counts (rank 0 samples); no memory until used.
        self.token_counts = TokenCounts(config.hf_config.vocab_size, self.device)
        self.sampled: tuple[torch.Tensor, dict[int, int]] | None = None  # async: the last step's
        self.graph_runner = None
        if use_cuda_graphs(self.device, config.enforce_eager, self.backend.name):
            self.graph_runner = CUDAGraphRunner(
                self.model,
                config.hf_config.hidden_size,
                config.max_num_seqs,
                config.max_model_len,
                self.block_size,
                self.dtype,
                self.device,
            )
        if is_cuda and config.num_kvcache_blocks > 0:
            self.warmup()  # nothing to size, but kernels compile now rather than in a step
        self.num_kvcache_blocks = self.allocate_kv_cache()
        if self.graph_runner is not None:
            self.graph_runner.capture()  # after the KV cache: the graphs hold its address

    def _init_tensor_parallel(self, port: int) -> TPGroup:
        """Rank 0 spawns ranks 1..N-1 (stopped at close, collection or exit); they join it.
        Under torchrun every rank joins its replica's group."""
        if self.config.tensor_parallel_size == 1 and self.launch is None:
            return SINGLE_RANK
        if not dist.is_available():
            raise ValueError(
                "tensor_parallel_size > 1 needs torch.distributed, which this PyTorch build lacks"
            )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.launch is not None:
            return join_replica_tp_group(self.launch, engine_store(self.launch), self.device)
        if self.rank > 0:
            return connect_worker(port, self.rank, self.config.tensor_parallel_size, self.device)
        self.workers = WorkerGroup.spawn(self.config, self.device, type(self))
        self._stop_workers = weakref.finalize(self, self.workers.shutdown)
        return self.workers.tp_group

    def _float32_bytes(self) -> int:
        """The model in float32 (counted on the meta device) and every rank's KV cache."""
        with torch.device("meta"):
            model = get_model_class(self.config.hf_config)(self.config.hf_config)
        kv_bytes = self.config.tensor_parallel_size * self.config.cpu_kvcache_space_gib * 2**30
        return 4 * sum(p.numel() for p in model.parameters()) + int(kv_bytes)

    def _build_model(self) -> torch.nn.Module:
        hf_config, previous_dtype = self.config.hf_config, torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # the parameters' dtype, restored even on failure
        try:
            with self.device, tp_group_scope(self.tp_group):
                model = get_model_class(hf_config)(hf_config)
        finally:
            torch.set_default_dtype(previous_dtype)
        if self.config.load_format == "dummy":
            load_dummy_weights(model, getattr(hf_config, "initializer_range", 0.02))
        else:
            load_model(model, self.config.model)
        return model.requires_grad_(False)

    def _pack_cpu_linears(self) -> None:
        """oneDNN-packed copies of the linears' weights (faster GEMMs at decode sizes) when
        the copies of every rank fit in a quarter of the RAM; else, or where oneDNN cannot
        pack this dtype, MKL's F.linear alone."""
        copies = self.config.tensor_parallel_size * sum(  # at most: norms are not copied
            p.numel() * p.element_size() for p in self.model.parameters()
        )
        if not torch.backends.mkldnn.is_available():
            choice = "F.linear only (oneDNN is unavailable)"
        elif copies > physical_memory() // 4:
            choice = (
                f"F.linear only ({copies / 2**30:.1f} GiB of copies would exceed a quarter "
                "of the RAM)"
            )
        else:
            try:
                choice = (
                    f"oneDNN-packed weights for {pack_linear_weights(self.model)} layers "
                    "(smaller ones: F.linear)"
                )
            except RuntimeError as e:  # e.g. bfloat16 without avx512 / avx_ne_convert
                choice = f"F.linear only ({str(e).splitlines()[0]})"
                pack_linear_weights(self.model, undo=True)
        logging.getLogger("nanovllm").info("CPU linears: %s", choice)

    def allocate_kv_cache(self) -> int:
        """Allocate the KV cache and bind it to the layers; the block count."""
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks < 0:
            # Block ids are shared by all ranks: each takes the smallest count any can fit.
            fits = torch.tensor([self._blocks_that_fit()], device=self.device)
            num_blocks = int(self.tp_group.all_reduce(fits, op="min").item())
        self.kv_cache = self._new_kv_cache(num_blocks)
        bind_kv_cache(self.attention_layers, self.kv_cache)
        return num_blocks

    def _new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(
            kv_cache_shape(self.attention_layers, num_blocks, self.block_size),
            dtype=self.dtype,
            device=self.device,
        )

    def _blocks_that_fit(self) -> int:
        """Blocks within the memory budget, at most what max_num_seqs full-length sequences use."""
        config = self.config
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
            hint = "lower max_model_len / max_num_batched_tokens or raise gpu_memory_utilization"
        else:
            budget, hint = int(config.cpu_kvcache_space_gib * 2**30), "raise cpu_kvcache_space_gib"
        block = math.prod(kv_cache_shape(self.attention_layers, 1, self.block_size))
        most = config.max_num_seqs * block_table_width(config.max_model_len, self.block_size)
        return min(num_blocks_within(budget, block * self.dtype.itemsize, hint), most)

    def _cuda_kv_budget(self) -> int:
        """Bytes left for the KV cache after the graphs' pool (a trial capture) and a warmup.
        PyTorch's cache is emptied first, so `free` includes the activations' memory."""
        graph_pool = 0
        if self.graph_runner is not None:
            bind_kv_cache(self.attention_layers, self._new_kv_cache(1))
            graph_pool = self.graph_runner.measure_pool()  # every row padding: 1 block will do
            bind_kv_cache(self.attention_layers, None)
        peak = self.warmup()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        grown = max(0, total - free - reserved - self.untracked_at_start)  # outside PyTorch
        profile = MemoryProfile(total, free, peak + grown, reserved + grown, graph_pool)
        return kv_cache_budget(profile, self.config.gpu_memory_utilization)

    @torch.inference_mode()
    def warmup(self) -> int:
        """The peak PyTorch-reserved memory of a prefill at the largest batch, then (rank 0) of
        the sampler at the most rows ([rows, vocab] float32 temporaries can outgrow it)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        config = self.config
        max_len = min(config.max_model_len, config.max_num_batched_tokens)
        num_seqs = min(config.max_num_batched_tokens // max_len, config.max_num_seqs)  # >= 1
        seqs = [Sequence([0] * max_len, None, self.block_size) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = max_len
            # Slots are computed but never written: there is no KV cache yet.
            seq.block_table.extend([0] * seq.num_blocks)
        self.forward(prepare_inputs(seqs, self.block_size))
        if self.rank == 0:
            self._warmup_sampler()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_reserved(self.device)

    def _warmup_sampler(self) -> None:
        """Every option at the most rows, then plain sampling at that many, one fewer and one:
        the compiled sampler compiles (static, dynamic, size 1) now, not in a run."""
        rows = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        vocab_size = self.config.hf_config.vocab_size
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
            seqs = [Sequence([0], params, self.block_size) for _ in range(num_rows)]
            counts = TokenCounts(vocab_size, self.device)  # dropped after: the worst case
            metadata = build_sampling_metadata(seqs, vocab_size, counts, self.device)
            logits = torch.zeros(num_rows, vocab_size, dtype=self.dtype, device=self.device)
            self.sampler(logits, metadata)

    def call(self, method: str, *args) -> object:
        """Rank 0: `method(*args)` on every rank, rank 0's result; RuntimeError if a worker died."""
        if self.workers is None:
            return getattr(self, method)(*args)
        return self.workers.call(getattr(self, method), method, args)

    def run(self, seqs: list[Sequence]) -> SamplerOutput | None:
        """One step: rank 0's token id per sequence and the logprobs asked for (under torchrun
        on every rank: each runs its own engine in lockstep)."""
        out = self.execute_model(seqs)
        # The step's one host sync (logprobs, when asked, had theirs in sample()).
        out = None if out is None else out._replace(token_ids=out.token_ids.tolist())
        if self.launch is not None:  # every rank's scheduler goes on with rank 0's tokens
            out = self.tp_group.all_gather_objects(out, self.device)[0]  # rank 0's
        return out

    @torch.inference_mode()
    def execute_model(self, seqs: list[Sequence]) -> SamplerOutput | None:
        """A step's work, queued on the device (spawned ranks get its host-built inputs
        through call()): the sampled ids [len(seqs)] on rank 0."""
        feed = None  # async scheduling: rows whose input is the step in flight's sampled id
        if self.config.async_scheduling:
            feed = [
                (row, self.sampled[1][seq.seq_id])
                for row, seq in enumerate(seqs)
                if seq.last_token == PENDING
            ] or None
        logits = self.call("forward", prepare_inputs(seqs, self.block_size), feed)
        if self.rank != 0:
            return None
        out = self.sample(seqs, logits)
        if self.config.async_scheduling:
            self.sampled = out.token_ids, {seq.seq_id: i for i, seq in enumerate(seqs)}
        return out

    @torch.inference_mode()
    def forward(
        self, inputs: StepInputs, feed: list[tuple[int, int]] | None = None
    ) -> torch.Tensor | None:
        """Every rank: host-built inputs onto the device, `feed`'s (row, row of the step
        before) inputs taken there from its sampled ids (no host round trip), the model."""
        input_ids, positions, ctx = on_device(inputs, self.device)
        if feed is not None:
            rows, previous_rows = list_to_device(feed, self.device).unbind(1)
            input_ids[rows] = self.sampled[0][previous_rows]
        return self._forward(input_ids, positions, ctx)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor | None:
        """Logits of each sequence's last row; a pure decode step replays a CUDA graph."""
        graphs = self.graph_runner
        with attention_context(ctx):
            if ctx.prefill is None and graphs and len(input_ids) <= graphs.batch_sizes[-1]:
                hidden_states = graphs.run(input_ids, positions, ctx)
            else:
                hidden_states = self.model(input_ids, positions)
            return self.model.compute_logits(hidden_states)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> SamplerOutput:
        """logits: each sequence's logits_rows() (its last row samples)."""
        rows = logits_rows(seqs)
        asked = find_logprob_rows(seqs, rows)
        raw = None if asked is None else raw_logprobs(logits, asked)  # before it is overwritten
        if rows is not None:
            logits = logits[to_device(torch.tensor(rows).cumsum(0) - 1, self.device)]
        metadata = build_sampling_metadata(seqs, logits.shape[-1], self.token_counts, self.device)
        token_ids = self.sampler(logits, metadata)
        return SamplerOutput(
            token_ids, *(collect_logprobs(asked, raw, token_ids, len(seqs)) if asked else ())
        )

    def close(self) -> None:
        """Free the graphs and the KV cache; rank 0 stops its workers, a worker leaves the group."""
        if self.workers is not None:
            self._stop_workers()  # a finalizer: runs WorkerGroup.shutdown at most once
        elif self.tp_group is not SINGLE_RANK:
            self.tp_group.shutdown()
        if self.graph_runner is not None:
            self.graph_runner.close()
            self.graph_runner = None
        bind_kv_cache(self.attention_layers, None)
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the device, e.g. for the next engine's sizing
