"""Rotary position embedding ("rotate half", as Qwen, Llama and Mistral): inv_freq[i] =
rope_theta ** (-2i / head_dim), or Llama 3.1's scaling of it (`llama3`). Layers with the same
RoPE share one [max_position, 2, head_dim] cos/sin cache (Qwen3's: 40 MiB)."""

import json
import weakref

import torch
from torch import nn

from nanovllm.compilation import HotOp

ROPE_TYPES = ("default", "llama3")  # llama3: Llama 3.1's scaling (rope_scaling.py)
# (head_dim, max_position, parameters, device) -> the cos/sin cache layers of it share; a
# cache lives as long as a model holds it.
_CACHES: "weakref.WeakValueDictionary[tuple, torch.Tensor]" = weakref.WeakValueDictionary()


class RotaryEmbedding(nn.Module):
    def __init__(self, cos_sin_cache: torch.Tensor):
        super().__init__()
        # [max_position, 2, head_dim]: (cos | cos) and (-sin | sin), each half head_dim // 2 wide
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)
        self._fn = apply_rotary_emb.select()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens]; q, k [num_tokens, heads or kv_heads, head_dim]."""
        return self._fn(positions, q, k, self.cos_sin_cache)


@HotOp
def apply_rotary_emb(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as one: x * (cos | cos) + (x2 | x1) * (-sin | sin), rounded as transformers'."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).unsqueeze(2).unbind(1)  # [n, 1, head_dim]
    x = torch.cat((q, k), dim=1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((x2, x1), dim=-1).mul_(sin).add_(x * cos)
    return rotated.split((q.shape[1], k.shape[1]), dim=1)


def get_rope(head_dim: int, max_position: int, rope_parameters: dict) -> RotaryEmbedding:
    """A layer's RoPE; an unsupported rope_type or a missing parameter is a ValueError."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: "
            f"{', '.join(map(repr, ROPE_TYPES))}"
        )
    partial = rope_parameters.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported; only 1.0 is")
    key = (
        head_dim,
        max_position,
        json.dumps(rope_parameters, sort_keys=True, default=str),
        str(torch.get_default_device()),
    )
    if (cache := _CACHES.get(key)) is None:
        inv_freq = default_inv_freq(head_dim, rope_parameters)
        if rope_type == "llama3":
            from nanovllm.layers.rope_scaling import llama3_inv_freq

            inv_freq = llama3_inv_freq(inv_freq, rope_parameters)
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        cache = _CACHES[key] = torch.stack((torch.cat((cos, cos), 1), torch.cat((-sin, sin), 1)), 1)
    return RotaryEmbedding(cache)


def default_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """rope_theta ** (-2i / head_dim), i < head_dim / 2."""
    base = float(params["rope_theta"])
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
