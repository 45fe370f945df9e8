"""Vocabulary-parallel embedding and LM head: each rank holds vocab/N rows."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.attention.metadata import get_context
from nanovllm.distributed.group import get_tp_group
from nanovllm.layers.linear import ColumnParallelLinear, FormattedWeight, divide


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank, self.tp_group.size
        self.shard_size = divide(num_embeddings, self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    weight_loader = ColumnParallelLinear.weight_loader  # its rows, as a column-parallel W's

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        y = y * in_shard.unsqueeze(-1).to(y.dtype)  # other ranks contribute these rows
        return self.tp_group.all_reduce(y)


class ParallelLMHead(FormattedWeight, VocabParallelEmbedding):
    """Logits of the rows the step asks for (logits_indices), gathered on rank 0, which samples.
    Its GEMM reads a WeightFormat when given one, as a linear layer's."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        indices = get_context().logits_indices
        if indices is not None:
            hidden_states = hidden_states[indices]
        # [num_seqs, vocab / N] on each rank -> [num_seqs, vocab] on rank 0
        return self.tp_group.gather_last_dim(self.linear(hidden_states, None))
