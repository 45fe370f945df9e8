"""Rotary position embedding (the "rotate half" layout Qwen3 uses)."""
import torch
from torch import nn

from nanovllm.compilation import HotOp


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        # [max_position, head_dim]: cos | sin, each [max_position, head_dim // 2]
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1),
                             persistent=False)
        self._fn = apply_rotary_emb.select()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens]; q [num_tokens, heads, head_dim]; k [num_tokens, kv_heads, head_dim]."""
        return self._fn(positions, q, k, self.cos_sin_cache)


@HotOp
def apply_rotary_emb(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def get_rope(head_dim: int, max_position: int, rope_parameters: dict) -> RotaryEmbedding:
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported; only 'default' RoPE is")
    return RotaryEmbedding(head_dim, max_position, float(rope_parameters["rope_theta"]))
