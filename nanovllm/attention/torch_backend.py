"""The `torch` attention backend: plain PyTorch on any device (kernels/torch_attention.py), the
reference the other backends are tested against. A CPU decodes straight from the paged cache in
C++ (kernels/cpu_decode.py) where that builds; elsewhere decode gathers each sequence's rows
(gathered_decode.py)."""

import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.kernels import cpu_decode, torch_attention


def why_not(device: torch.device, block_size: int) -> str | None:
    return None  # runs anywhere


class TorchBackend:
    name = "torch"
    capturable = False  # store_kvcache syncs with the host (for the -1 padding slots)
    store_kvcache = staticmethod(torch_attention.store_kvcache)

    def __init__(self, native_cpu_decode: bool = True) -> None:
        """native_cpu_decode=False: the gathering decode on the CPU too (the reference)."""
        self.native_cpu_decode = native_cpu_decode
        self._plan: tuple[AttentionMetadata, list] | None = None  # gathered decode: (ctx, groups)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return torch_attention.prefill_attention(
            q, k, v, k_cache, v_cache, ctx.seqlens_q, ctx.seqlens_k, ctx.block_tables, scale
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if self.native_cpu_decode and q.is_cpu and k_cache.dtype in cpu_decode.DTYPES:
            if (library := cpu_decode.load()) is not None:
                return cpu_decode.paged_decode(
                    library, q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale
                )
        from nanovllm.attention.gathered_decode import decode_groups, gathered_decode

        if self._plan is None or self._plan[0] is not ctx:  # a step's first layer plans it
            self._plan = ctx, decode_groups(ctx.block_tables, ctx.context_lens, k_cache.shape[1])
        return gathered_decode(q, k_cache, v_cache, self._plan[1], scale)


Backend = TorchBackend
