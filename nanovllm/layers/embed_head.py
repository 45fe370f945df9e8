"""Vocabulary-parallel embedding and LM head: each rank holds vocab/N rows."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.context import get_context
from nanovllm.layers.linear import copy_checked, divide, tp_rank_and_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.num_embeddings = num_embeddings
        self.shard_size = divide(num_embeddings, self.tp_size, "vocab_size")
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected "
                             f"({self.num_embeddings}, {param.shape[1]})")
        copy_checked(param, loaded.narrow(0, self.vocab_start, self.shard_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        y = y * in_shard.unsqueeze(-1).to(y.dtype)  # other ranks contribute these rows
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the last token of each sequence only (all of them in decode),
    gathered on rank 0, the only rank that samples."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        context = get_context()
        if context.is_prefill:
            hidden_states = hidden_states[context.cu_seqlens_q[1:] - 1]
        logits = F.linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        shards = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, shards, dst=0)
        return torch.cat(shards, dim=-1) if self.tp_rank == 0 else None
