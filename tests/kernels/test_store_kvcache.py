"""store_kvcache against the torch reference: every slot written exactly, padding
(-1) slots writing nothing, the rest of the NaN-poisoned cache left untouched."""

import pytest
import torch
from kernel_cases import DEVICE, NAN, randn, requires_kernels

from nanovllm.attention.torch_backend import TorchBackend

pytestmark = [pytest.mark.cuda, requires_kernels]


@pytest.mark.parametrize(
    "dtype,num_kv_heads,head_dim,block_size",
    [
        (torch.float32, 2, 64, 16),
        (torch.bfloat16, 4, 128, 256),
        (torch.float16, 1, 128, 16),
    ],
)
def test_store_kvcache_writes_each_slot_and_skips_padding(
    dtype, num_kv_heads, head_dim, block_size
):
    from nanovllm.kernels import store_kvcache

    gen = torch.Generator().manual_seed(0)
    num_blocks = 3
    # the first and last slot of a block, a middle one, the cache's last slot; -1 twice
    slots = [0, block_size - 1, -1, block_size + 5, num_blocks * block_size - 1, -1, block_size]
    slot_mapping = torch.tensor(slots, device=DEVICE)
    # k, v with a token stride wider than a row, as the model's views of its qkv output
    kv = randn(len(slots), 3 * num_kv_heads * head_dim, dtype=dtype, gen=gen)
    k = kv[:, : num_kv_heads * head_dim].view(len(slots), num_kv_heads, head_dim)
    v = kv[:, 2 * num_kv_heads * head_dim :].view(len(slots), num_kv_heads, head_dim)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.full(shape, NAN, dtype=dtype, device=DEVICE) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    TorchBackend().store_kvcache(k, v, k_ref, v_ref, slot_mapping)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)
    written = (~k_cache.isnan()).all(-1).all(-1).flatten().sum().item()
    assert written == len(slots) - slots.count(-1)


def test_store_kvcache_int32_slots_and_no_tokens():
    from nanovllm.kernels import store_kvcache

    k_cache = torch.full((2, 16, 2, 64), NAN, device=DEVICE)
    v_cache = torch.full_like(k_cache, NAN)
    k = torch.ones(1, 2, 64, device=DEVICE)
    store_kvcache(k, 2 * k, k_cache, v_cache, torch.tensor([17], dtype=torch.int32, device=DEVICE))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[1, 1], 2 * k[0])
    empty = torch.empty(0, 2, 64, device=DEVICE)
    store_kvcache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.long, device=DEVICE))
    assert (~k_cache.isnan()).all(-1).all(-1).sum().item() == 1
