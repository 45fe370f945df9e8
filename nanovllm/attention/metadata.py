"""Per-step attention metadata: the model runner fills it, the attention layers read it,
inside `attention_context(...)` only (a failed step cannot leak it into the next)."""
from dataclasses import dataclass

import torch

from nanovllm.utils import Scoped


@dataclass(slots=True)
class AttentionMetadata:
    """Tensors live on the model's device; the lists are host copies for CPU-side loops.

    Prefill (a chunk of each sequence; keys = cached prefix + the chunk):

        sequence i:  [ cached prefix | chunk (seqlen_q) ]
                     0          seqlen_k - seqlen_q      seqlen_k

    Decode: one query token per sequence, attending over `context_lens` tokens.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor                 # [num_tokens] cache slot of each new K/V; -1 = skip
    block_tables: torch.Tensor | None = None   # [num_seqs, max_blocks] (-1 padded); None: no prefix
    # prefill
    cu_seqlens_q: torch.Tensor | None = None   # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor | None = None   # [num_seqs + 1] int32
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    seqlens_q: list[int] | None = None
    seqlens_k: list[int] | None = None
    # decode
    context_lens: torch.Tensor | None = None   # [num_seqs] int32


_current: Scoped[AttentionMetadata | None] = Scoped(None)
attention_context = _current.scope


def get_context() -> AttentionMetadata:
    if _current.value is None:
        raise RuntimeError("attention metadata is only available inside attention_context()")
    return _current.value
