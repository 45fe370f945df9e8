"""A launcher given a wrong layout fails an assertion naming the argument, before any
kernel reads memory with the wrong strides (the callers are our own backends)."""

import pytest
import torch
from kernel_cases import DEVICE, requires_kernels

pytestmark = [pytest.mark.cuda, requires_kernels]
H, HKV, D, BS, NB = 4, 2, 64, 16, 3


def tensors() -> dict:
    """A valid set of arguments for all three launchers (2 decode / 2 prefill sequences)."""

    def t(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=DEVICE)

    return dict(
        q=t(2, H, D),
        k=t(2, HKV, D),
        v=t(2, HKV, D),
        k_cache=t(NB, BS, HKV, D),
        v_cache=t(NB, BS, HKV, D),
        slot_mapping=t(2, dtype=torch.long),
        block_tables=t(2, 2, dtype=torch.int32),
        context_lens=t(2, dtype=torch.int32),
        cu_q=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
        cu_k=torch.tensor([0, 3, 6], dtype=torch.int32, device=DEVICE),
    )


def store(a):
    from nanovllm.kernels import store_kvcache

    store_kvcache(a["k"], a["v"], a["k_cache"], a["v_cache"], a["slot_mapping"])


def decode(a, **kw):
    from nanovllm.kernels import paged_decode_attention

    paged_decode_attention(
        a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["context_lens"], 0.125, **kw
    )


def prefill(a, max_seqlen_q=1, **kw):
    from nanovllm.kernels import paged_prefill_attention

    paged_prefill_attention(
        a["q"],
        a["k"],
        a["v"],
        a["k_cache"],
        a["v_cache"],
        a["cu_q"],
        a["cu_k"],
        max_seqlen_q,
        a["block_tables"],
        0.125,
        **kw,
    )


def prefill_without_prefix(a):
    from nanovllm.kernels import paged_prefill_attention

    paged_prefill_attention(
        a["q"], a["k"], a["v"], a["k_cache"], a["v_cache"], a["cu_q"], a["cu_q"], 1, None, 0.125
    )


def test_valid_arguments_pass_the_checks():
    a = tensors()
    store(a), decode(a), prefill(a), prefill_without_prefix(a)


@pytest.mark.parametrize(
    "launch,names,change,match",
    [
        (store, "k", lambda t: t[0], r"k must be a 3-D float tensor"),
        (
            store,
            "v",
            lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),
            r"v must be .* contiguous last",
        ),
        (store, "k", lambda t: t.double(), r"k must be a 3-D float tensor .* got torch.float64"),
        (store, "v", lambda t: t.half(), r"v is torch.float16 .*, not torch.float32"),
        (
            store,
            "k_cache v_cache",
            lambda t: t[:, :, :1].contiguous(),
            r"k_cache's num_kv_heads is not k's",
        ),
        (store, "v_cache", lambda t: t[1:], r"v_cache must have the layout of k_cache"),
        (
            store,
            "slot_mapping",
            lambda t: t.float(),
            r"slot_mapping must be a contiguous 1-D int32/int64",
        ),
        (store, "slot_mapping", lambda t: t[:1], r"slot_mapping .* of 2 rows"),
        (decode, "q", lambda t: t[:, :3], r"do not fit q's \(num_heads, head_dim\) \(3, 64\)"),
        (
            decode,
            "k_cache v_cache",
            lambda t: t.half(),
            r"k_cache is torch.float16 .*, not torch.float32",
        ),
        (
            decode,
            "block_tables",
            lambda t: t.short(),
            r"block_tables must be a contiguous 2-D int32/int64",
        ),
        (decode, "block_tables", lambda t: t.t(), r"block_tables must be a contiguous 2-D"),
        (decode, "context_lens", lambda t: t[:1], r"context_lens .* of 2 rows"),
        (prefill, "cu_k", lambda t: t[:2], r"cu_seqlens_k .* of 3 rows"),
        (
            prefill,
            "cu_q",
            lambda t: t.float(),
            r"cu_seqlens_q must be a contiguous 1-D int32/int64",
        ),
        (prefill, "block_tables", lambda t: t[:1], r"block_tables .* of 2 rows"),
        (prefill_without_prefix, "k", lambda t: t[:1], r"k's shape \(1, 2, 64\)"),
        (prefill_without_prefix, "v", lambda t: t[..., :32], r"v's shape \(2, 2, 32\)"),
    ],
)
def test_bad_layout_fails_an_assertion_naming_it(launch, names, change, match):
    a = tensors()
    for name in names.split():
        a[name] = change(a[name])
    with pytest.raises(AssertionError, match=match):
        launch(a)


def test_bad_scalars_fail_assertions():
    a = tensors()
    with pytest.raises(AssertionError, match="num_splits"):
        decode(a, num_splits=0)
    with pytest.raises(AssertionError, match="max_seqlen_q"):
        prefill(a, max_seqlen_q=-1)
    with pytest.raises(AssertionError, match="out's shape"):
        decode(a, out=torch.empty(1, H, D, device=DEVICE))
