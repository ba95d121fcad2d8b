"""Mixture of experts: sqrtsoftplus top-k (or token-id hash) routing, clamped SwiGLU, shared expert."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.families.v4.config import ModelConfig
from deepinfer.model.layers import Linear, empty
from deepinfer.kernels import Ops

class Gate(nn.Module):
    """Router. Top-k layers pick experts by score + `bias`; hash layers look them up in `tid2eid`."""

    MATMUL_WEIGHTS = ("weight",)

    def __init__(self, config: ModelConfig, ops: Ops, hashed: bool, dtype, device) -> None:
        super().__init__()
        self.ops = ops
        self.hashed = hashed
        self.top_k = config.num_experts_per_tok
        self.scale = config.routed_scaling_factor
        self.score_func = config.scoring_func
        self.weight = empty(config.n_routed_experts, config.hidden_size, dtype=dtype, device=device)
        if hashed:
            self.tid2eid = nn.Buffer(torch.zeros(config.vocab_size, self.top_k, dtype=torch.long, device=device))
        else:
            self.bias = empty(config.n_routed_experts, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = self.tid2eid[input_ids] if self.hashed else None
        return self.ops.moe_gate(self.ops.linear(x, self.weight), self.score_func, None if self.hashed else self.bias,
                                 chosen, self.top_k, self.scale)


class Experts(nn.Module):
    """The routed experts, stacked: w13 = [w1; w3] per expert, w2 the down projection. `held` lists
    the expert each stacked slot holds: all of them in order, unless expert parallelism gave this
    rank a share (`deepinfer.parallel`), set before the weights load."""

    MATMUL_WEIGHTS = ("w13", "w2")

    def __init__(self, config: ModelConfig, ops: Ops, dtype, device) -> None:
        super().__init__()
        self.ops = ops
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.held = tuple(range(e))
        self.w13 = empty(e, 2 * i, h, dtype=dtype, device=device)
        self.w2 = empty(e, h, i, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                shared: torch.Tensor | None = None) -> torch.Tensor:
        """The combined routed output, plus `shared` (the shared expert's [T, H]) when given."""
        return self.ops.moe_experts(x, indices, weights, self.w13, self.w2, self.limit, shared=shared)

    def outputs(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Each row [S, H] through the expert of its stacked slot [S], unweighted."""
        return self.ops.expert_outputs(rows, slots, self.w13, self.w2, self.limit)


class SharedExpert(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, dtype, device) -> None:
        super().__init__()
        self.ops = ops
        h, i = config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.w1 = Linear(h, i, ops, dtype, device)
        self.w2 = Linear(i, h, ops, dtype, device)
        self.w3 = Linear(h, i, ops, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.ops.clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    """Gate, routed experts and shared expert. With expert parallelism, `exchange`
    (`deepinfer.parallel.experts.ExpertExchange`) sends the routed slots to the ranks holding their
    experts and combines what comes back."""

    exchange = None

    def __init__(self, config: ModelConfig, ops: Ops, mlp_type: str, dtype, device) -> None:
        super().__init__()
        self.gate = Gate(config, ops, mlp_type == "hash_moe", dtype, device)
        self.experts = Experts(config, ops, dtype, device)
        self.shared_experts = SharedExpert(config, ops, dtype, device)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' combined output plus the shared expert's, added in the combine (one
        launch on CUDA)."""
        indices, weights = self.gate(x, input_ids)
        shared = self.shared_experts(x)
        if self.exchange is None:
            return self.experts(x, indices, weights, shared)
        return self.exchange.routed(x, indices, weights, shared)
