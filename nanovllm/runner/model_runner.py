"""ModelRunner: builds the model and its KV cache on a device, runs each scheduled batch
(step_inputs.py) and samples. With tensor parallelism there is one per rank: rank 0 drives each
step with `call("forward", inputs)` (the step's host-built tensors; workers never see a
Sequence) and alone samples.

What differs between devices is the platform's (platforms/): the runner asks it, never which
device it is on. Built in order: the platform (device, threads), the dtype, the model (its hot
ops the platform's, its weights prepared by the platform once loaded), the decode fast path
(CUDA graphs, a CPU's native step), the KV cache (its budget the platform's: measured on CUDA),
then the fast path's capture, which holds the cache's address."""

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from nanovllm.attention.backend import select_backend
from nanovllm.attention.metadata import attention_context
from nanovllm.compilation import ops_scope
from nanovllm.config import PUBLISHED_QUANTIZATIONS, Config
from nanovllm.core.block_manager import block_table_width
from nanovllm.core.sequence import Sequence
from nanovllm.device import list_to_device, torch_dtype
from nanovllm.distributed import launched_by_torchrun
from nanovllm.distributed.group import SINGLE_RANK, TPGroup, tp_group_scope
from nanovllm.layers.attention import Attention
from nanovllm.models.hf_config import checkpoint_dtype
from nanovllm.models.loader import load_model
from nanovllm.models.registry import get_model_class
from nanovllm.platforms import Placement, get_platform
from nanovllm.runner.kv_cache import bind_kv_cache, kv_cache_shape, num_blocks_within
from nanovllm.runner.step_inputs import StepInputs, prepare_inputs
from nanovllm.runner.warmup import largest_prefill, sampler_batches
from nanovllm.sampling.metadata import LogitsHook, SamplingMetadataBuilder
from nanovllm.sampling.sampler import Sampler, SamplerOutput

if TYPE_CHECKING:
    from nanovllm.lora.request import LoRARequest
    from nanovllm.sampling.verify import VerifyOutput


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, port: int = 0):
        """Rank 0 is built by the engine; ranks > 0 by distributed/workers.py's worker_main,
        which passes the `port` of rank 0's store."""
        self.config = config
        self.block_size = config.kvcache_block_size
        self.launch = None  # torchrun's place of this process, when it started it
        if launched_by_torchrun():
            from nanovllm.distributed.launch import torchrun_launch

            self.launch = torchrun_launch(config.tensor_parallel_size, config.data_parallel_size)
        self.rank = rank if self.launch is None else self.launch.tp_rank
        self.platform = get_platform(config, self._placement())
        self.device = self.platform.device
        self.dtype = self._pick_dtype()
        self.backend = select_backend(
            config.attention_backend,
            self.platform.attention_backends,
            self.device,
            self.block_size,
        )
        self.workers = None  # rank 0's handle on the spawned ranks 1..N-1
        self.tp_group = self._init_tensor_parallel(port)
        self.lora = None  # the LoRA adapters (lora/manager.py), with enable_lora
        with ops_scope(self.platform.op_choice()):  # the hot ops the platform chose
            self.model = self._build_model()
            self.sampler = Sampler()
            if config.enable_lora:
                from nanovllm.lora.manager import LoRAManager

                self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.backend
        self.sampling_metadata = SamplingMetadataBuilder(config.hf_config.vocab_size, self.device)
        self.fast_decode = self.platform.fast_decode(self.model, self.dtype, self.backend)
        self.num_kvcache_blocks = self.allocate_kv_cache()
        if self.fast_decode is not None:
            self.fast_decode.capture()  # after the KV cache: it holds its address

    # -- building --------------------------------------------------------------------------

    def _placement(self) -> Placement:
        """A GPU per rank: torchrun's LOCAL_RANK, a spawned rank's number, or the current one;
        the engine's ranks on this machine share its CPUs."""
        if self.launch is not None:
            return Placement(self.launch.local_rank, self.launch.local_rank + 1, 1)
        tp_size = self.config.tensor_parallel_size
        if tp_size > 1:
            return Placement(self.rank, tp_size, tp_size)
        return Placement(None, 1, 1)

    def _pick_dtype(self) -> torch.dtype:
        """An explicit dtype is obeyed; "auto" is the checkpoint's, or the platform's choice
        (a CPU that only emulates it computes in float32)."""
        name = self.config.dtype
        if name == "auto":
            model_class = get_model_class(self.config.hf_config)
            name = self.platform.auto_dtype(checkpoint_dtype(self.config.hf_config), model_class)
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
        elif self.config.quantization in PUBLISHED_QUANTIZATIONS:  # GPTQ, AWQ, GGUF
            from nanovllm.quantization import load_published

            load_published(model, self.config.model, self.config.gguf_file, hf_config)
        else:
            load_model(model, self.config.model)
        model.requires_grad_(False)
        self.platform.prepare_weights(model)  # packed, or quantized: a weight format
        return model

    # -- the KV cache --------------------------------------------------------------------

    def allocate_kv_cache(self) -> int:
        """Allocate the KV cache and bind it to the layers; the block count."""
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks < 0:
            # Block ids are shared by all ranks: each takes the smallest count any can fit.
            fits = torch.tensor([self._blocks_that_fit()], device=self.device)
            num_blocks = int(self.tp_group.all_reduce(fits, op="min").item())
        else:
            self.platform.warmup(self)
        self.kv_cache = self.new_kv_cache(num_blocks)
        bind_kv_cache(self.attention_layers, self.kv_cache)
        return num_blocks

    def new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        shape = kv_cache_shape(self.attention_layers, num_blocks, self.block_size)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _blocks_that_fit(self) -> int:
        """Blocks within the platform's budget, at most what max_num_seqs full-length sequences
        use."""
        budget = self.platform.kv_cache_budget(self)
        block_bytes = math.prod(kv_cache_shape(self.attention_layers, 1, self.block_size))
        block_bytes *= self.dtype.itemsize
        most = self.config.max_num_seqs * block_table_width(
            self.config.max_model_len, self.block_size
        )
        return min(num_blocks_within(budget, block_bytes, self.platform.kv_cache_hint), most)

    @contextmanager
    def trial_kv_cache(self) -> Iterator[None]:
        """A one-block KV cache bound to the layers meanwhile (a platform sizing memory)."""
        bind_kv_cache(self.attention_layers, self.new_kv_cache(1))
        try:
            yield
        finally:
            bind_kv_cache(self.attention_layers, None)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest prefill a step can hold, then (rank 0) the sampler at its most rows with
        every option on (warmup.py): a platform reads its peak memory; compiled ops compile."""
        self.forward(prepare_inputs(largest_prefill(self.config, self.block_size), self.block_size))
        if self.rank != 0:
            return
        vocab_size = self.config.hf_config.vocab_size
        for seqs in sampler_batches(self.config, self.block_size):
            # A builder of its own: the penalties' counts are dropped after, the worst case.
            metadata = SamplingMetadataBuilder(vocab_size, self.device).build(seqs)
            logits = torch.zeros(len(seqs), vocab_size, dtype=self.dtype, device=self.device)
            self.sampler(logits, metadata)

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
        self.platform.after_step()
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
        logits = self.call("forward", self._step_inputs(seqs), feed)
        if self.rank != 0:
            return None
        return self.sample(seqs, logits)

    def _step_inputs(self, seqs: list[Sequence]) -> StepInputs:
        """A batch's inputs (step_inputs.py), with each row's LoRA adapter where enabled: the
        adapters it needs are put in their slots on every rank first."""
        inputs = prepare_inputs(seqs, self.block_size)
        if self.lora is None:
            return inputs
        loads, mapping = self.lora.schedule(seqs)
        if loads:
            self.call("lora_call", "load_slots", loads)
        return inputs._replace(context=replace(inputs.context, lora=mapping))

    def add_lora(self, request: "LoRARequest") -> bool:
        """Rank 0 reads and checks an adapter, then the other ranks load it: a bad one is
        refused before they are asked, so they stay in step. False if it was known."""
        added = self.lora.add(request)
        if added and self.workers is not None:
            self.workers.call(lambda *args: None, "lora_call", ("add", request))
        return added

    def lora_call(self, method: str, *args) -> object:
        """This rank's LoRAManager.method(*args): call("lora_call", ...) runs it on every rank."""
        return getattr(self.lora, method)(*args)

    @torch.inference_mode()
    def forward(
        self, inputs: StepInputs, feed: tuple[torch.Tensor, list[tuple[int, int]]] | None = None
    ) -> torch.Tensor | None:
        """Every rank: host-built inputs onto the device, then the model; the logits of each
        sequence's last row (on rank 0). `feed` = (the step before's sampled ids, [(row, its row
        in that step)]): rows whose input token is still on the device, taken there."""
        input_ids, positions, ctx = self.platform.to_device(inputs)
        if feed is not None:
            previous_ids, pairs = feed
            rows, previous_rows = list_to_device(pairs, self.device).unbind(1)
            input_ids[rows] = previous_ids[previous_rows]
        fast = self.fast_decode
        with attention_context(ctx):
            if ctx.prefill is None and fast is not None and fast.can_run(len(input_ids)):
                return fast.run(input_ids, positions, ctx)
            return self.model.compute_logits(self.model(input_ids, positions))

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> SamplerOutput:
        """Rank 0: a token per sequence from its last logits row; logprobs where asked."""
        if any(seq.logprobs is not None or seq.needs_prompt_logits for seq in seqs):
            from nanovllm.sampling.logprobs import sample_with_logprobs

            return sample_with_logprobs(self.sampler, self.sampling_metadata, seqs, logits)
        return SamplerOutput(self.sampler(logits, self.sampling_metadata.build(seqs)))

    @torch.inference_mode()
    def run_verify(self, seqs: list[Sequence], drafts: dict[int, list[int]]) -> "VerifyOutput":
        """Speculative decoding's step (engine/speculative.py): a decoding sequence with d
        `drafts` is 1 + d decode rows (step_inputs.py), each row sampled with its position's
        settings (sampling/verify.py); the others are sampled as run() samples them."""
        from nanovllm.sampling.verify import VerifyOutput, sample_positions, split_rows

        logits = self.call("forward", self._step_inputs(seqs), None)
        is_verified = [seq.seq_id in drafts for seq in seqs]
        plain = [seq for seq, v in zip(seqs, is_verified) if not v]
        verified = [seq for seq, v in zip(seqs, is_verified) if v]
        # Logits rows: a verified sequence's every position; a prompt chunk's all while it
        # owes prompt logprobs; else each sequence's last.
        rows = [
            seq.num_scheduled_tokens if v or seq.needs_prompt_logits else 1
            for seq, v in zip(seqs, is_verified)
        ]
        plain_logits, verified_logits = split_rows(logits, rows, is_verified)
        out = SamplerOutput([])
        if plain:
            out = self.sample(plain, plain_logits)
            out = out._replace(token_ids=out.token_ids.tolist())
        builder = self.sampling_metadata
        sampled, entries = sample_positions(
            self.sampler, builder, verified, drafts, verified_logits
        )
        self.platform.after_step()
        return VerifyOutput(out, sampled.tolist(), entries)

    def add_logits_hook(self, hook: LogitsHook) -> None:
        """Rank 0: a per-step mask over the logits before sampling (structured outputs')."""
        self.sampling_metadata.add_logits_hook(hook)

    def close(self) -> None:
        """Free the fast path and the KV cache; rank 0 stops its workers, a worker leaves the
        group."""
        if self.workers is not None:
            self._stop_workers()  # a finalizer: runs WorkerGroup.shutdown at most once
        elif self.tp_group is not SINGLE_RANK:
            self.tp_group.shutdown()
        if self.fast_decode is not None:
            self.fast_decode.close()
            self.fast_decode = None
        bind_kv_cache(self.attention_layers, None)
        self.kv_cache = None
        self.platform.release_memory()
