"""The CUDA-graph runner's logic on the CPU: which sizes are captured, how a batch is
padded into the static buffers, and the whole engine running its decode steps through
those buffers with a stand-in for the graphs (test_cuda.py replays real ones)."""

from types import SimpleNamespace

import pytest
import torch
from conftest import hf_greedy
from graph_cases import (
    BLOCK,
    EDGE_MAX_MODEL_LEN,
    edge_of_max_model_len,
    graph_workload,
    record_replays,
)

from nanovllm import LLM, SamplingParams
from nanovllm.attention.flash_attn_backend import FlashAttnBackend
from nanovllm.attention.metadata import AttentionMetadata, ForwardContext, attention_context
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.attention.triton_backend import TritonBackend
from nanovllm.core.block_manager import block_table_width
from nanovllm.platforms.cuda import captures_decode
from nanovllm.platforms.cuda.graphs import CUDAGraphRunner, capture_batch_sizes

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device name: no GPU is touched


@pytest.mark.parametrize(
    "max_num_seqs,sizes",
    [
        (512, [1, 2, 4, 8] + list(range(16, 513, 16))),
        (2000, [1, 2, 4, 8] + list(range(16, 513, 16))),  # 512 at most: larger batches run eagerly
        (40, [1, 2, 4, 8, 16, 32, 40]),  # the limit itself, so 33..40 replay too
        (16, [1, 2, 4, 8, 16]),
        (3, [1, 2, 3]),
        (1, [1]),
    ],
)
def test_captured_batch_sizes(max_num_seqs, sizes):
    assert capture_batch_sizes(max_num_seqs) == sizes


def test_block_table_buffer_holds_max_model_len_plus_the_decoded_token():
    # nano-vLLM issue #106: a 4096-token sequence decoding its next token needs 17 blocks
    assert block_table_width(4096, 256) == 17
    assert block_table_width(4095, 256) == 16
    assert block_table_width(64, 16) == 5


def test_graphs_only_with_a_capturable_backend_and_not_under_enforce_eager():
    # the classes: their instances would import triton and flash-attn
    assert captures_decode(False, TritonBackend) and captures_decode(False, FlashAttnBackend)
    assert not captures_decode(True, TritonBackend)
    assert not captures_decode(False, TorchBackend)  # its store_kvcache syncs the host


def decode_metadata(
    block_tables: list[list[int]], slots: list[int], context_lens: list[int]
) -> ForwardContext:
    decode = AttentionMetadata(
        block_tables=torch.tensor(block_tables, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
    )
    return ForwardContext(torch.tensor(slots), decode=decode, num_decode_tokens=len(slots))


def test_loading_a_batch_pads_its_rows_and_clears_what_the_last_one_left():
    # 8 rows; a block table of 4 blocks of 4 holds max_model_len 15 + the decoded token
    config = SimpleNamespace(
        hf_config=SimpleNamespace(hidden_size=2),
        max_num_seqs=8,
        max_model_len=15,
        kvcache_block_size=4,
        enable_lora=False,
    )
    buffers = CUDAGraphRunner(None, config, torch.float32, CPU)
    wide = decode_metadata(
        [[5, 6, 7], [1, 2, -1], [3, -1, -1], [4, 9, 8]], [40, 17, 50, 70], [41, 18, 3, 35]
    )
    buffers.load(torch.tensor([11, 12, 13, 14]), torch.tensor([40, 17, 2, 34]), wide, size=4)
    narrow = decode_metadata([[7], [2]], [9, 3], [10, 4])
    buffers.load(torch.tensor([21, 22]), torch.tensor([9, 3]), narrow, size=4)
    assert buffers.input_ids[:2].tolist() == [21, 22]
    assert buffers.positions[:2].tolist() == [9, 3]
    assert buffers.slot_mapping[:4].tolist() == [9, 3, -1, -1]  # padding writes nothing
    assert buffers.context_lens[:4].tolist() == [10, 4, 0, 0]  # padding reads nothing
    assert buffers.block_tables[:4].tolist() == [
        [7, -1, -1, -1],
        [2, -1, -1, -1],
        [-1] * 4,
        [-1] * 4,
    ]
    view = buffers.metadata(4)
    assert view.prefill is None and view.num_decode_tokens == 4
    assert view.decode.block_tables.data_ptr() == buffers.block_tables.data_ptr()
    assert view.decode.context_lens.shape == (4,) and view.slot_mapping.shape == (4,)


class ReplayEagerly(CUDAGraphRunner):
    """A stand-in for CUDA graphs on the CPU: "replaying" size s runs the model on the
    first s rows of the static buffers, which is what a graph captured there does."""

    def capture(self) -> None:
        self.graphs = {size: _EagerReplay(self, size) for size in self.batch_sizes}


class _EagerReplay:
    def __init__(self, runner: ReplayEagerly, size: int):
        self.runner, self.size = runner, size

    def replay(self) -> None:
        with attention_context(self.runner.metadata(self.size)):
            self.runner._forward(self.size)

    def reset(self) -> None:
        """A real graph frees its memory here; the stand-in holds none."""


def with_stand_in_graphs(llm: LLM) -> list[int]:
    runner = llm.model_runner
    config = llm.config
    runner.fast_decode = ReplayEagerly(runner.model, config, runner.dtype, runner.device)
    runner.fast_decode.capture()
    return record_replays(runner.fast_decode)


def test_decode_through_the_padded_static_buffers_matches_transformers(checkpoints):
    path = str(checkpoints["gqa"])
    prompts, params = graph_workload()
    with LLM(
        path,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=160,
        max_num_seqs=40,
        max_num_batched_tokens=96,
    ) as llm:
        replays = with_stand_in_graphs(llm)
        outputs = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.scheduler.block_manager.num_cache_hit_blocks >= 2  # the identical prompts
    assert set(replays) - set(capture_batch_sizes(40))  # sizes between captured ones ran
    assert outputs == [hf_greedy(path, tuple(p), sp.max_tokens) for p, sp in zip(prompts, params)]


def test_decode_at_the_last_position_of_max_model_len_fits_the_buffers(checkpoints):
    path = str(checkpoints["gqa"])
    prompts, lengths = edge_of_max_model_len()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(
        path,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=32,
        max_num_seqs=4,
        max_model_len=EDGE_MAX_MODEL_LEN,
    ) as llm:
        replays = with_stand_in_graphs(llm)
        outputs = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert replays  # the last decode steps went through the buffers
    assert outputs == [hf_greedy(path, tuple(p), n) for p, n in zip(prompts, lengths)]
