"""Mixture of experts: sqrtsoftplus top-k (or token-id hash) routing, clamped SwiGLU, shared expert."""

from __future__ import annotations

import torch
from torch import nn

import kernels
from deepinfer.config import ModelConfig
from deepinfer.model.layers import Linear, empty

SCORE_FUNCS = {
    "sqrtsoftplus": lambda logits: kernels.softplus(logits).sqrt(),
    "softmax": lambda logits: kernels.softmax(logits).to(logits.dtype),
    "sigmoid": lambda logits: kernels.sigmoid(logits),
}


class Gate(nn.Module):
    """Router. Top-k layers pick experts by score + `bias`; hash layers look them up in `tid2eid`."""

    MATMUL_WEIGHTS = ("weight",)

    def __init__(self, config: ModelConfig, hashed: bool, dtype, device) -> None:
        super().__init__()
        self.hashed = hashed
        self.top_k = config.num_experts_per_tok
        self.scale = config.routed_scaling_factor
        self.score = SCORE_FUNCS[config.scoring_func]
        self.weight = empty(config.n_routed_experts, config.hidden_size, dtype=dtype, device=device)
        if hashed:
            self.tid2eid = nn.Buffer(torch.zeros(config.vocab_size, self.top_k, dtype=torch.long, device=device))
        else:
            self.bias = empty(config.n_routed_experts, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(kernels.linear(x, self.weight))
        if self.hashed:
            indices = self.tid2eid[input_ids]
        else:
            indices = kernels.topk_indices(scores + self.bias, self.top_k)
        weights = scores.gather(1, indices)
        weights = weights / (kernels.ordered_sum(weights, dim=-1).unsqueeze(-1) + 1e-20)
        return indices, weights * self.scale


class Experts(nn.Module):
    """The routed experts, stacked: w13 = [w1; w3] per expert, w2 the down projection."""

    MATMUL_WEIGHTS = ("w13", "w2")

    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.w13 = empty(e, 2 * i, h, dtype=dtype, device=device)
        self.w2 = empty(e, h, i, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return kernels.moe_experts(x, indices, weights, self.w13, self.w2, self.limit)


class SharedExpert(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        h, i = config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.w1 = Linear(h, i, dtype, device)
        self.w2 = Linear(i, h, dtype, device)
        self.w3 = Linear(h, i, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(kernels.clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, mlp_type: str, dtype, device) -> None:
        super().__init__()
        self.gate = Gate(config, mlp_type == "hash_moe", dtype, device)
        self.experts = Experts(config, dtype, device)
        self.shared_experts = SharedExpert(config, dtype, device)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        indices, weights = self.gate(x, input_ids)
        return self.experts(x, indices, weights) + self.shared_experts(x)
