"""Running one engine over several processes (`torchrun`): expert parallelism and attention data
parallelism whose outputs are the bits one process gives (`layout`, `experts`, `placement`)."""

from deepinfer.parallel.experts import ExpertExchange, move_experts, spread_experts
from deepinfer.parallel.layout import (ParallelError, ParallelLayout, agree, from_rank_zero, gather_objects,
                                      process_rank, start_layout)
from deepinfer.parallel.placement import ExpertPlacement, PlacementError, balanced_placement, placement_digest

__all__ = ["ExpertExchange", "ExpertPlacement", "ParallelError", "ParallelLayout", "PlacementError", "agree",
           "balanced_placement", "from_rank_zero", "gather_objects", "move_experts", "placement_digest",
           "process_rank", "spread_experts", "start_layout"]
