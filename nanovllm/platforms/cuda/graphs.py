"""Decode CUDA graphs (docs/cuda.md), the CUDA platform's decode fast path (a FastDecode,
platforms/interface.py): a batch of n replays the smallest captured size >= n
from static buffers whose rows n.. are padding:

    row             0 .. n-1                       n .. size-1 (padding)
    input_ids       the batch's                    stale (any valid token id)
    positions       the batch's                    stale (any valid position)
    slot_mapping    the batch's                    -1: store_kvcache writes nothing
    context_lens    the batch's                    0: attention reads nothing
    block_tables    the batch's, -1 past its width -1
    lora_slots      the batch's (-1: no adapter)   -1: no adapter (with enable_lora)

The block-table buffer holds max_model_len + 1 tokens' blocks (nano-vLLM issue #106)."""

from bisect import bisect_left

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata, ForwardContext, attention_context
from nanovllm.config import Config
from nanovllm.core.block_manager import block_table_width


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    limit = min(max_num_seqs, 512)
    return [n for n in (1, 2, 4, 8) if n < limit] + list(range(16, limit, 16)) + [limit]


class CUDAGraphRunner:
    """The decode graphs of one model, their memory pool and the static buffers they read
    and write (rows: the largest batch; every row padding until a batch is loaded)."""

    def __init__(self, model: nn.Module, config: Config, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.device = device
        self.batch_sizes = capture_batch_sizes(config.max_num_seqs)
        rows = self.batch_sizes[-1]
        width = block_table_width(config.max_model_len, config.kvcache_block_size)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids, self.positions = torch.zeros(rows, **i64), torch.zeros(rows, **i64)
        self.slot_mapping = torch.full((rows,), -1, **i64)
        self.context_lens = torch.zeros(rows, **i32)
        self.block_tables = torch.full((rows, width), -1, **i32)
        # each row's LoRA slot, read by the adapters' kernels on the device (lora/)
        self.lora_slots = torch.full((rows,), -1, **i64) if config.enable_lora else None
        hidden_size = config.hf_config.hidden_size
        self.outputs = torch.zeros(rows, hidden_size, dtype=dtype, device=device)  # hidden states
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # the memory pool every graph shares

    def metadata(self, size: int) -> ForwardContext:
        """A decode step viewing the first `size` rows (what a graph captures)."""
        decode = AttentionMetadata(self.block_tables[:size], context_lens=self.context_lens[:size])
        lora = None
        if self.lora_slots is not None:
            from nanovllm.lora.mapping import LoRAMapping

            lora = LoRAMapping(self.lora_slots[:size], [])
        return ForwardContext(self.slot_mapping[:size], decode, num_decode_tokens=size, lora=lora)

    def load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, size: int
    ) -> None:
        """Copy a decode batch of n <= size rows in; rows n .. size-1 become padding."""
        n, width = ctx.decode.block_tables.shape
        assert n <= size and width <= self.block_tables.shape[1], "batch exceeds the buffers"
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:size].fill_(-1)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        self.context_lens[:size].zero_()
        self.context_lens[:n].copy_(ctx.decode.context_lens)
        self.block_tables[:size].fill_(-1)
        self.block_tables[:n, :width].copy_(ctx.decode.block_tables)
        if self.lora_slots is not None:
            self.lora_slots[:size].fill_(-1)
            if ctx.lora is not None:
                self.lora_slots[:n].copy_(ctx.lora.slots)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every size, largest first, once the KV cache is bound (graphs hold its address)."""
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):
            self.graphs[size] = self.capture_size(size)

    def capture_size(self, size: int) -> torch.cuda.CUDAGraph:
        """The graph of one batch size, in the current pool."""
        graph = torch.cuda.CUDAGraph()
        with attention_context(self.metadata(size)):
            self._forward(size)  # eagerly first: Triton and torch.compile compile here
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    self._forward(size)
            except RuntimeError as e:
                raise RuntimeError(
                    f"capturing the decode CUDA graph of batch size {size} failed "
                    f"({e}); enforce_eager=True runs without graphs"
                ) from e
        return graph

    def _forward(self, size: int) -> None:
        self.outputs[:size] = self.model(self.input_ids[:size], self.positions[:size])

    def can_run(self, num_seqs: int) -> bool:
        """A decode batch this large replays a graph (a larger one runs eagerly)."""
        return num_seqs <= self.batch_sizes[-1]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The logits [n, vocab] (rank 0's), of the hidden states the graph left in its output
        buffer."""
        n = input_ids.shape[0]
        size = self.batch_sizes[bisect_left(self.batch_sizes, n)]
        self.load(input_ids, positions, ctx, size)
        self.graphs[size].replay()
        return self.model.compute_logits(self.outputs[:n])

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs, self.pool = {}, None
        self.input_ids = self.positions = self.slot_mapping = None  # and the static buffers
        self.context_lens = self.block_tables = self.outputs = self.lora_slots = None
