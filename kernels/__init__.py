"""The one dispatch point for the model's numerical primitives.

The model calls these names and nothing else for arithmetic that reduces, so that an
implementation with other numerics (batch-invariant, Triton) can be swapped in here alone.
"""

from kernels.reference import (
    clamped_swiglu,
    grouped_linear,
    indexer_scores,
    linear,
    log_softmax,
    moe_experts,
    rms_norm,
    rotary,
    sink_attention,
    sinkhorn,
    softmax,
    topk_indices,
    unweighted_rms_norm,
    window_pool,
)

__all__ = [
    "clamped_swiglu",
    "grouped_linear",
    "indexer_scores",
    "linear",
    "log_softmax",
    "moe_experts",
    "rms_norm",
    "rotary",
    "sink_attention",
    "sinkhorn",
    "softmax",
    "topk_indices",
    "unweighted_rms_norm",
    "window_pool",
]
