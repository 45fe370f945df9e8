"""The decode launcher is CUDA-graph safe: no host sync, and a captured graph replayed on
new values in its static buffers equals an eager call (CUDA only)."""

import pytest
import torch
from kernel_cases import DEVICE, paged_cache, randn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (outside the interpreter)"),
]
NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, BLOCK = 2, 8, 128, 16


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_replays_in_a_cuda_graph_without_host_syncs(num_splits):
    from nanovllm.kernels import paged_decode_attention

    gen = torch.Generator().manual_seed(0)
    lens = [40, 1, 0, 300]
    cache = paged_cache(lens, NUM_KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16, gen)
    q = randn(len(lens), NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, gen=gen)
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def decode():
        return paged_decode_attention(
            q,
            cache.k_cache,
            cache.v_cache,
            cache.block_tables,
            context_lens,
            HEAD_DIM**-0.5,
            num_splits=num_splits,
        )

    decode()  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        decode()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode()
    # new values in the same buffers: other queries, other context lengths (within the
    # filled slots: the rest is NaN poison)
    q.copy_(randn(*q.shape, dtype=q.dtype, gen=gen))
    context_lens.copy_(torch.tensor([39, 1, 0, 257], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    eager = decode()
    assert not out.isnan().any() and torch.equal(out, eager)
