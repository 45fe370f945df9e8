"""Time the Triton decode kernel against its memory floor on a CUDA GPU.

    python benchmarks/decode_attention.py

Decode reads every cached K and V row once, so its floor is (bytes of K/V read) /
(copy bandwidth measured here). Shapes: Qwen3-0.6B's attention (16 query heads, 8 KV
heads, head_dim 128), bfloat16, 256-token blocks, every sequence at the same length.
"""

import torch
from triton.testing import do_bench

from nanovllm.kernels import paged_decode_attention
from nanovllm.kernels.paged_attention import decode_num_splits

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK, DTYPE = 16, 8, 128, 256, torch.bfloat16


def copy_bandwidth(gib: int = 2) -> float:
    """Bytes per second of a device-to-device copy, counting what it reads and writes."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def time_decode(num_seqs: int, context_len: int, num_splits: int | None) -> tuple[float, int]:
    """Milliseconds per call and the K/V bytes it reads."""
    blocks_per_seq = -(-context_len // BLOCK)
    shape = (num_seqs * blocks_per_seq, BLOCK, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    block_tables = torch.randperm(shape[0], device="cuda", dtype=torch.int32).view(num_seqs, -1)
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device="cuda")
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    ms = do_bench(
        lambda: paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, HEAD_DIM**-0.5, num_splits=num_splits
        )
    )
    return ms, 2 * num_seqs * context_len * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize


def main() -> None:
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(
        f"{'seqs':>5} {'context':>7} {'splits':>6} {'ms':>8} {'floor ms':>8} {'GB/s':>6} "
        f"{'of floor':>8}"
    )
    for num_seqs in (1, 8, 64, 256, 512):
        for context_len in (512, 4096):
            auto = decode_num_splits(num_seqs, NUM_KV_HEADS, context_len, torch.device("cuda"))
            for num_splits in sorted({1, auto}):
                ms, nbytes = time_decode(num_seqs, context_len, num_splits)
                floor_ms = nbytes / bandwidth * 1e3
                print(
                    f"{num_seqs:>5} {context_len:>7} {num_splits:>6} {ms:>8.3f} {floor_ms:>8.3f} "
                    f"{nbytes / (ms * 1e-3) / 1e9:>6.0f} {floor_ms / ms:>8.0%}"
                )
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
