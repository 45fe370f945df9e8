"""ModelRunner: builds the model and its KV cache on a device, runs each scheduled batch
(step_inputs.py) and samples. With tensor parallelism there is one per rank: rank 0 drives each
step with `call("forward", inputs)` (the step's host-built tensors; workers never see a
Sequence) and alone samples.

Built in order: the device and dtype, the model (on CUDA with compiled small ops), on CUDA the
memory measurements that size the KV cache (runner/cuda.py), the KV cache, then the decode CUDA
graphs, which hold its address."""

import math
import weakref

import torch

from nanovllm.attention.backend import AttentionBackend, select_backend
from nanovllm.attention.metadata import attention_context
from nanovllm.compilation import compile_scope
from nanovllm.config import Config
from nanovllm.core.sequence import Sequence
from nanovllm.device import list_to_device, resolve_device, torch_dtype
from nanovllm.distributed import launched_by_torchrun
from nanovllm.distributed.group import SINGLE_RANK, TPGroup, tp_group_scope
from nanovllm.layers.attention import Attention
from nanovllm.models.hf_config import checkpoint_dtype
from nanovllm.models.loader import load_model
from nanovllm.models.registry import get_model_class
from nanovllm.runner import cpu
from nanovllm.runner.cpu_threads import ThreadGovernor, set_num_threads
from nanovllm.runner.kv_cache import (
    bind_kv_cache,
    block_table_width,
    kv_cache_shape,
    num_blocks_within,
)
from nanovllm.runner.step_inputs import StepInputs, prepare_inputs
from nanovllm.sampling.metadata import SamplingMetadataBuilder
from nanovllm.sampling.sampler import Sampler, SamplerOutput


def use_cuda_graphs(device: torch.device, enforce_eager: bool, backend: AttentionBackend) -> bool:
    """On CUDA unless enforce_eager; only a backend whose decode never syncs with the host can
    be captured."""
    return device.type == "cuda" and not enforce_eager and backend.capturable


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, port: int = 0):
        """Rank 0 is built by the engine; ranks > 0 by distributed/workers.py's worker_main,
        which passes the `port` of rank 0's store."""
        self.config = config
        self.block_size = config.kvcache_block_size
        self.governor = None  # a CPU's: fewer threads while the CPU is shared (cpu_threads.py)
        self.launch = None  # torchrun's place of this process, when it started it
        if launched_by_torchrun():
            from nanovllm.distributed.launch import torchrun_launch

            self.launch = torchrun_launch(config.tensor_parallel_size, config.data_parallel_size)
        self.rank = rank if self.launch is None else self.launch.tp_rank
        self.device = self._pick_device()
        if self.device.type == "cpu":
            cpu.keep_freed_host_memory()
            ranks_here = config.tensor_parallel_size if self.launch is None else 1
            threads = set_num_threads(config.cpu_threads, ranks_here)
            if threads.chosen and threads.num_threads > 1 and ranks_here == 1:
                self.governor = ThreadGovernor(threads.num_threads)
        self.dtype = self._pick_dtype()
        self.backend = select_backend(config.attention_backend, self.device, self.block_size)
        self.workers = None  # rank 0's handle on the spawned ranks 1..N-1
        self.tp_group = self._init_tensor_parallel(port)
        self.untracked_at_start = 0  # CUDA memory in use outside PyTorch before we began
        if self.device.type == "cuda":
            from nanovllm.runner import cuda

            self.untracked_at_start = cuda.untracked_memory(self.device)
        # On CUDA the small ops are compiled (not under enforce_eager); a CPU calls native twins.
        with compile_scope(self.device.type == "cuda" and not config.enforce_eager):
            self.model = self._build_model()
            self.sampler = Sampler()
        if self.device.type == "cpu" and config.quantization is None:
            cpu.pack_linear_weights_if_they_fit(self.model, config.tensor_parallel_size)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.backend
        self.sampling_metadata = SamplingMetadataBuilder(config.hf_config.vocab_size, self.device)
        self.graph_runner = self._make_graph_runner()
        self.num_kvcache_blocks = self.allocate_kv_cache()
        if self.graph_runner is not None:
            self.graph_runner.capture()  # after the KV cache: the graphs hold its address

    # -- building --------------------------------------------------------------------------

    def _pick_device(self) -> torch.device:
        """A GPU per rank: torchrun's LOCAL_RANK, a spawned rank's number, or the current one."""
        if self.launch is not None:
            index, needed = self.launch.local_rank, self.launch.local_rank + 1
        elif self.config.tensor_parallel_size > 1:
            index, needed = self.rank, self.config.tensor_parallel_size
        else:
            index, needed = None, 1
        return resolve_device(self.config.device, index, needed)

    def _pick_dtype(self) -> torch.dtype:
        """An explicit dtype is obeyed; "auto" is the checkpoint's, except on a CPU that only
        emulates it (runner/cpu.py)."""
        name = self.config.dtype
        if name == "auto":
            name = checkpoint_dtype(self.config.hf_config)
            if self.device.type == "cpu":
                name = cpu.auto_dtype(name, self.config, get_model_class(self.config.hf_config))
        return torch_dtype(name)

    def _init_tensor_parallel(self, port: int) -> TPGroup:
        """One rank: no group. Else rank 0 spawns ranks 1..N-1 (stopped at close, collection or
        exit) and they join it; under torchrun every rank joins its replica's group."""
        if self.config.tensor_parallel_size == 1 and self.launch is None:
            return SINGLE_RANK
        from nanovllm.distributed.workers import init_tensor_parallel

        tp_group, self.workers = init_tensor_parallel(
            self.config, self.device, self.rank, port, self.launch, type(self)
        )
        if self.workers is not None:
            self._stop_workers = weakref.finalize(self, self.workers.shutdown)
        return tp_group

    def _build_model(self) -> torch.nn.Module:
        hf_config, previous_dtype = self.config.hf_config, torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # the parameters' dtype, restored even on failure
        try:
            with self.device, tp_group_scope(self.tp_group):
                model = get_model_class(hf_config)(hf_config)
        finally:
            torch.set_default_dtype(previous_dtype)
        if self.config.load_format == "dummy":
            from nanovllm.models.dummy import load_dummy_weights

            load_dummy_weights(model, getattr(hf_config, "initializer_range", 0.02))
        else:
            load_model(model, self.config.model)
        if self.config.quantization is not None:  # a weight format: quantized once loaded
            from nanovllm.layers.quantization import quantize_model

            quantize_model(model.requires_grad_(False), self.config.quantization)
        return model.requires_grad_(False)

    def _make_graph_runner(self):
        """Decode CUDA graphs (runner/cuda_graph.py), or a CPU's native step (cpu_step.py)."""
        if self.device.type == "cpu" and (self.config.cpu_decode_step or self.config.quantization):
            from nanovllm.runner.cpu_step import native_decode_step

            return native_decode_step(self.model, self.config, self.dtype)
        if not use_cuda_graphs(self.device, self.config.enforce_eager, self.backend):
            return None
        from nanovllm.runner.cuda_graph import CUDAGraphRunner

        return CUDAGraphRunner(self.model, self.config, self.dtype, self.device)

    # -- the KV cache --------------------------------------------------------------------

    def allocate_kv_cache(self) -> int:
        """Allocate the KV cache and bind it to the layers; the block count."""
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks < 0:
            # Block ids are shared by all ranks: each takes the smallest count any can fit.
            fits = torch.tensor([self._blocks_that_fit()], device=self.device)
            num_blocks = int(self.tp_group.all_reduce(fits, op="min").item())
        elif self.device.type == "cuda":
            from nanovllm.runner import cuda

            cuda.warmup(self)  # nothing to size, but kernels compile now rather than in a step
        self.kv_cache = self.new_kv_cache(num_blocks)
        bind_kv_cache(self.attention_layers, self.kv_cache)
        return num_blocks

    def new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        shape = kv_cache_shape(self.attention_layers, num_blocks, self.block_size)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _blocks_that_fit(self) -> int:
        """Blocks within the memory budget, at most what max_num_seqs full-length sequences use."""
        config = self.config
        if self.device.type == "cuda":
            from nanovllm.runner import cuda

            budget = cuda.measure_kv_cache_budget(self)
            hint = "lower max_model_len / max_num_batched_tokens or raise gpu_memory_utilization"
        else:
            budget, hint = int(config.cpu_kvcache_space_gib * 2**30), "raise cpu_kvcache_space_gib"
        block_bytes = math.prod(kv_cache_shape(self.attention_layers, 1, self.block_size))
        block_bytes *= self.dtype.itemsize
        most = config.max_num_seqs * block_table_width(config.max_model_len, self.block_size)
        return min(num_blocks_within(budget, block_bytes, hint), most)

    # -- a step --------------------------------------------------------------------------

    def call(self, method: str, *args) -> object:
        """Rank 0: `method(*args)` on every rank, rank 0's result; RuntimeError if a worker died."""
        if self.workers is None:
            return getattr(self, method)(*args)
        return self.workers.call(getattr(self, method), method, args)

    def run(self, seqs: list[Sequence]) -> SamplerOutput | None:
        """One step: rank 0's token id per sequence and the logprobs asked for (under torchrun
        on every rank: each runs its own engine in lockstep)."""
        out = self.execute_model(seqs)
        if self.governor is not None:
            self.governor.after_step()
        # The step's one host sync (logprobs, when asked, had theirs in sample()).
        if out is not None:
            out = out._replace(token_ids=out.token_ids.tolist())
        if self.launch is not None:  # every rank's scheduler goes on with rank 0's tokens
            from nanovllm.distributed.launch import all_gather_objects

            out = all_gather_objects(self.tp_group, out, self.device)[0]
        return out

    @torch.inference_mode()
    def execute_model(
        self, seqs: list[Sequence], feed: tuple[torch.Tensor, list[tuple[int, int]]] | None = None
    ) -> SamplerOutput | None:
        """A step's work, queued on the device: on rank 0 the sampled ids [len(seqs)] (still on
        the device) and the logprobs asked for. `feed` (async scheduling): see forward()."""
        logits = self.call("forward", prepare_inputs(seqs, self.block_size), feed)
        if self.rank != 0:
            return None
        return self.sample(seqs, logits)

    @torch.inference_mode()
    def forward(
        self, inputs: StepInputs, feed: tuple[torch.Tensor, list[tuple[int, int]]] | None = None
    ) -> torch.Tensor | None:
        """Every rank: host-built inputs onto the device, then the model; the logits of each
        sequence's last row (on rank 0). `feed` = (the step before's sampled ids, [(row, its row
        in that step)]): rows whose input token is still on the device, taken there."""
        if self.device.type == "cuda":
            from nanovllm.runner.cuda import on_device

            inputs = on_device(inputs, self.device)
        input_ids, positions, ctx = inputs
        if feed is not None:
            previous_ids, pairs = feed
            rows, previous_rows = list_to_device(pairs, self.device).unbind(1)
            input_ids[rows] = previous_ids[previous_rows]
        graphs = self.graph_runner
        with attention_context(ctx):
            if ctx.prefill is None and graphs is not None and graphs.can_run(len(input_ids)):
                hidden_states = graphs.run(input_ids, positions, ctx)
            else:
                hidden_states = self.model(input_ids, positions)
            return self.model.compute_logits(hidden_states)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> SamplerOutput:
        """Rank 0: a token per sequence from its last logits row; logprobs where asked."""
        if any(seq.logprobs is not None or seq.needs_prompt_logits for seq in seqs):
            from nanovllm.sampling.logprobs import sample_with_logprobs

            return sample_with_logprobs(self.sampler, self.sampling_metadata, seqs, logits)
        return SamplerOutput(self.sampler(logits, self.sampling_metadata.build(seqs)))

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
