"""Decode CUDA graphs: the model's forward over a decode batch, captured once per batch
size (1, 2, 4, 8, then every 16 up to min(max_num_seqs, 512)) and replayed each step.
A batch of n replays the smallest captured size >= n from static buffers; rows n.. are
padding (README, "CUDA", has the why of each choice):

    row             0 .. n-1                       n .. size-1 (padding)
    input_ids       the batch's                    stale (any valid token id)
    positions       the batch's                    stale (any valid position)
    slot_mapping    the batch's                    -1: store_kvcache writes nothing
    context_lens    the batch's                    0: attention reads nothing
    block_tables    the batch's, -1 past its width -1

The block-table buffer holds max_model_len + 1 tokens' blocks (nano-vLLM issue #106).
Graphs are captured largest first into one memory pool; only backends whose decode has
no host sync (`triton`, `flash_attn`) can be captured.
"""
from bisect import bisect_left
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata, ForwardContext, attention_context

CAPTURABLE_BACKENDS = frozenset({"triton", "flash_attn"})
MAX_CAPTURED_BATCH = 512


def use_cuda_graphs(device: torch.device, enforce_eager: bool, backend: str) -> bool:
    return device.type == "cuda" and not enforce_eager and backend in CAPTURABLE_BACKENDS


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture, ascending."""
    limit = min(max_num_seqs, MAX_CAPTURED_BATCH)
    return [n for n in (1, 2, 4, 8) if n < limit] + list(range(16, limit, 16)) + [limit]


def block_table_width(max_model_len: int, block_size: int) -> int:
    """Blocks of the longest sequence a decode step can see, plus the token it decodes."""
    return -(-(max_model_len + 1) // block_size)


@dataclass(slots=True)
class DecodeBuffers:
    """The static inputs and output every graph reads and writes; rows = max batch."""
    input_ids: torch.Tensor     # [rows] int64
    positions: torch.Tensor     # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64, -1 = padding
    context_lens: torch.Tensor  # [rows] int32, 0 = padding
    block_tables: torch.Tensor  # [rows, width] int32, -1 past each row's blocks
    outputs: torch.Tensor       # [rows, hidden_size] the model's hidden states

    @classmethod
    def allocate(cls, rows: int, width: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> "DecodeBuffers":
        """Every row padding: safe to run before any batch is loaded."""
        def index(*shape: int, value: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.full(shape, value, dtype=dt, device=device)

        return cls(input_ids=index(rows, value=0), positions=index(rows, value=0),
                   slot_mapping=index(rows, value=-1),
                   context_lens=index(rows, value=0, dt=torch.int32),
                   block_tables=index(rows, width, value=-1, dt=torch.int32),
                   outputs=torch.zeros(rows, hidden_size, dtype=dtype, device=device))

    def metadata(self, size: int) -> ForwardContext:
        """A decode step viewing the first `size` rows (what a graph captures)."""
        decode = AttentionMetadata(is_prefill=False, block_tables=self.block_tables[:size],
                                   context_lens=self.context_lens[:size])
        return ForwardContext(self.slot_mapping[:size], decode=decode, num_decode_tokens=size)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
             size: int) -> None:
        """Copy a decode batch of n <= size rows in; rows n .. size-1 become padding."""
        metadata = ctx.decode
        n, width = metadata.block_tables.shape
        assert n <= size and width <= self.block_tables.shape[1], "batch exceeds the buffers"
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:size].fill_(-1)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        self.context_lens[:size].zero_()
        self.context_lens[:n].copy_(metadata.context_lens)
        self.block_tables[:size].fill_(-1)
        self.block_tables[:n, :width].copy_(metadata.block_tables)


class CUDAGraphRunner:
    """The decode graphs of one model and their static buffers and memory pool."""

    def __init__(self, model: nn.Module, hidden_size: int, max_num_seqs: int,
                 max_model_len: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.device = device
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.buffers = DecodeBuffers.allocate(self.batch_sizes[-1],
                                              block_table_width(max_model_len, block_size),
                                              hidden_size, dtype, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # the memory pool every graph shares

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first. The attention layers' KV cache must be the
        one replays will use: the graphs hold its address."""
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):
            self.graphs[size] = self._capture(size)

    @torch.inference_mode()
    def measure_pool(self) -> int:
        """Bytes the graphs' pool will take, before the KV cache is sized: the largest
        size captured on trial (every row padding, so any KV cache bound will do) and
        released again. Smaller graphs reuse the same memory."""
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        graph = self._capture(self.batch_sizes[-1])
        used = torch.cuda.memory_reserved(self.device) - before
        graph.reset()
        self.pool = None
        torch.cuda.empty_cache()
        return max(0, used)

    def _capture(self, size: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with attention_context(self.buffers.metadata(size)):
            self._forward(size)  # eagerly first: Triton and torch.compile compile here
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    self._forward(size)
            except RuntimeError as e:
                raise RuntimeError(f"capturing the decode CUDA graph of batch size {size} failed "
                                   f"({e}); enforce_eager=True runs without graphs") from e
        return graph

    def _forward(self, size: int) -> None:
        b = self.buffers
        b.outputs[:size] = self.model(b.input_ids[:size], b.positions[:size])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor:
        """The hidden states [n, hidden_size] of a decode batch of n <= the largest
        captured size: a view of the output buffer, valid until the next replay."""
        n = input_ids.shape[0]
        size = self.batch_sizes[bisect_left(self.batch_sizes, n)]
        self.buffers.load(input_ids, positions, ctx, size)
        self.graphs[size].replay()
        return self.buffers.outputs[:n]

    def close(self) -> None:
        """Release the graphs, their pool and the buffers."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = None
        self.buffers = None
