"""Mixture of experts: a router picks each token's top-k experts, each a SwiGLU MLP.

    probs = softmax(router_logits)            [num_tokens, num_experts], in float32
    topk_weights, topk_ids = topk(probs, k)   rescaled to sum to 1 when norm_topk_prob
    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]
    w13_weight [num_experts, 2 * intermediate / tp, hidden]   each expert's gate | up (vLLM's)
    w2_weight  [num_experts, hidden, intermediate / tp]       each expert's down

TP shards every expert's intermediate dim: a partial sum per rank, all-reduced once per layer;
the router is replicated. The experts are a hot op: on CUDA the platform gives the layer the
Triton grouped GEMM (kernels/fused_moe.py), capturable, in their place."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.compilation import HotOp
from nanovllm.distributed.group import get_tp_group
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.linear import default_weight_loader, divide, rank_slice


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_tokens, num_experts] -> (weights, ids) [num_tokens, top_k], as transformers casts."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(router_logits.dtype), topk_ids


@HotOp
def fused_moe_torch(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The reference: hidden_states [num_tokens, hidden]; w13 [E, 2 * I, hidden]; w2 [E, hidden,
    I]; topk_* [num_tokens, top_k] -> [num_tokens, hidden], expert by expert as transformers."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()  # pair p = token * top_k + slot
    order = flat_ids.argsort(stable=True)  # pairs grouped by expert
    tokens, weights = order // top_k, topk_weights.flatten()[order]
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    out = torch.zeros_like(hidden_states)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            x = hidden_states[tokens[rows]]
            y = F.linear(silu_and_mul.eager(F.linear(x, w13[expert])), w2[expert])
            out.index_add_(0, tokens[rows], y * weights[rows, None])
        start += count
    return out


def expert_params_mapping(num_experts: int) -> list[tuple[str, str, tuple[int, str]]]:
    """(parameter part, checkpoint part, shard id) for the loader, as vLLM's: the
    checkpoint's `mlp.experts.7.up_proj.weight` is shard (7, "w3") of `mlp.experts.w13_weight`."""
    projections = (("gate_proj", "w13", "w1"), ("up_proj", "w13", "w3"), ("down_proj", "w2", "w2"))
    return [
        (f"experts.{param}_", f"experts.{expert}.{projection}.", (expert, shard))
        for expert in range(num_experts)
        for projection, param, shard in projections
    ]


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
    ):
        super().__init__()
        self.tp_group = get_tp_group()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        shard = divide(intermediate_size, self.tp_group.size)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * shard, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, shard))
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        self._experts = fused_moe_torch.select()  # CUDA's platform: the Triton grouped GEMM

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]
    ) -> None:
        """This rank's slice of one expert's whole gate ("w1"), up ("w3") or down ("w2") proj."""
        expert, name = shard_id
        shard = self.w2_weight.shape[2]
        if name == "w2":
            default_weight_loader(param.data[expert], rank_slice(loaded, 1, shard, self.tp_group))
        else:
            rows = param.data[expert].narrow(0, 0 if name == "w1" else shard, shard)
            default_weight_loader(rows, rank_slice(loaded, 0, shard, self.tp_group))

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [num_tokens, hidden]; router_logits [num_tokens, num_experts]."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = self._experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return self.tp_group.all_reduce(out)
