"""Per-step attention metadata, set by the runner inside `attention_context(...)` only."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanovllm.utils import Scoped

if TYPE_CHECKING:
    from nanovllm.lora.mapping import LoRAMapping


@dataclass(slots=True)
class AttentionMetadata:
    """What a backend's prefill or decode reads (tensors on the model's device, lists on the
    host). Prefill: a chunk of each sequence over keys = its cached prefix + the chunk:

        sequence i:  [ cached prefix | chunk (seqlen_q) ]
                     0          seqlen_k - seqlen_q      seqlen_k

    Decode: one query token per sequence, attending over `context_lens` tokens."""

    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] (-1 padded); None: no prefix
    # prefill
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1] int32
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    seqlens_q: list[int] | None = None
    seqlens_k: list[int] | None = None
    # decode
    context_lens: torch.Tensor | None = None  # [num_seqs] int32


@dataclass(slots=True)
class ForwardContext:
    """One forward's batch: decode rows first (one token each), then prefill chunks.

        tokens   [ d0 d1 .. d(n-1) | chunk of p0 ...... | chunk of p1 .... ]
                   decode            prefill (cu_seqlens_q counts from its start)

    A pure decode step (what CUDA graphs capture) has no `prefill`, a pure prefill step
    no `decode`."""

    slot_mapping: torch.Tensor  # [num_tokens] every new K/V's slot; -1 = skip
    decode: AttentionMetadata | None = None  # rows [0, num_decode_tokens)
    prefill: AttentionMetadata | None = None  # the rows after them
    num_decode_tokens: int = 0
    logits_indices: torch.Tensor | None = None  # [num_seqs] each sequence's last row; None: all
    lora: "LoRAMapping | None" = None  # each row's LoRA adapter (lora/), when a row has one


_current: Scoped[ForwardContext | None] = Scoped(None)
attention_context = _current.scope


def get_context() -> ForwardContext:
    assert _current.value is not None, "attention metadata exists only inside attention_context()"
    return _current.value
